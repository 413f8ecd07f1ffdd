#include "server/run_journal.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <set>

#include "absl/strings/str_cat.h"
#include "lib/io/crc32c.h"
#include "lib/io/file_util.h"
#include "lib/log.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {

constexpr const char* kRunFile = "run.pb";
constexpr const char* kJournalFile = "journal";

// Every journal file (run.pb and journal) starts with this; a file without it (empty,
// truncated to nothing, overwritten) is damaged, never an empty journal.
constexpr absl::string_view kFileMagic = "LSJOURN\n";
constexpr uint8_t kRecordVersion = 1;
// A record: the body's length (4 bytes, little-endian), the CRC-32C of the version byte and
// the body (4 bytes, little-endian), the version byte, then the serialized message.
constexpr size_t kRecordHeader = 9;

void PutU32(uint32_t v, std::string* out) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t GetU32(const std::string& data, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(data[at + i])) << (8 * i);
  return v;
}

std::string Framed(const google::protobuf::MessageLite& message) {
  std::string versioned(1, static_cast<char>(kRecordVersion));
  versioned += message.SerializeAsString();
  std::string out;
  PutU32(static_cast<uint32_t>(versioned.size() - 1), &out);
  PutU32(Crc32c(versioned), &out);
  return out + versioned;
}

// The length of the intact record of type M at `at` (header included), or 0: it does not fit,
// its checksum or version is wrong, or it does not parse.
template <typename M>
size_t IntactRecordAt(const std::string& data, size_t at, M* out) {
  if (at + kRecordHeader > data.size()) return 0;
  const uint64_t n = GetU32(data, at);
  if (n > data.size() - at - kRecordHeader) return 0;
  const absl::string_view versioned(data.data() + at + 8, n + 1);
  if (Crc32c(versioned) != GetU32(data, at + 4) || static_cast<uint8_t>(versioned[0]) != kRecordVersion) return 0;
  if (!out->ParseFromArray(versioned.data() + 1, static_cast<int>(n))) return 0;
  return kRecordHeader + n;
}

// The records of a journal file and where (if anywhere) they stop being intact.
struct ParsedFile {
  std::vector<v1::JournalEntry> records;
  enum class Damage { kNone, kTornTail, kDamaged } damage = Damage::kNone;
  size_t damage_at = 0;  // the byte where the first bad record starts
};

// Reads records up to the first that is not intact. Nothing intact after it: a torn tail (a
// crash mid-append). An intact record after it: damage, which recovery never cuts away.
ParsedFile ParseJournal(const std::string& data) {
  ParsedFile parsed;
  if (data.size() < kFileMagic.size() || absl::string_view(data).substr(0, kFileMagic.size()) != kFileMagic) {
    parsed.damage = ParsedFile::Damage::kDamaged;
    return parsed;
  }
  size_t at = kFileMagic.size();
  while (at < data.size()) {
    v1::JournalEntry e;
    const size_t n = IntactRecordAt(data, at, &e);
    if (n == 0) break;
    parsed.records.push_back(std::move(e));
    at += n;
  }
  if (at == data.size()) return parsed;
  parsed.damage_at = at;
  parsed.damage = ParsedFile::Damage::kTornTail;
  for (size_t p = at + 1; p + kRecordHeader <= data.size(); ++p) {
    v1::JournalEntry e;
    if (IntactRecordAt(data, p, &e) != 0) {
      parsed.damage = ParsedFile::Damage::kDamaged;
      break;
    }
  }
  return parsed;
}

std::string JournalFileOf(const std::vector<v1::JournalEntry>& records) {
  std::string out(kFileMagic);
  for (const auto& e : records) out += Framed(e);
  return out;
}

// The run as of the marker at all[keep - 1] (keep 0: as created): the entries up to it, the
// marker durable, no done records.
JournaledRun CutAt(const v1::JournalRun& created, const std::vector<v1::JournalEntry>& all, size_t keep) {
  JournaledRun r;
  r.created = created;
  r.autosaved = keep > 0;
  r.run = r.autosaved ? all[keep - 1].run() : created.run();
  r.autosave_name = !r.autosaved ? "" : all[keep - 1].autosave_name().empty() ? "autosave" : all[keep - 1].autosave_name();
  for (size_t i = 0; i < keep; ++i) {
    if (!all[i].autosave_done().empty()) continue;
    r.entries.push_back(all[i]);
  }
  if (r.autosaved) r.entries.back().set_autosave_pending(false);
  return r;
}

}  // namespace

absl::StatusOr<RunJournal> RunJournal::Open(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("journal_dir: empty");
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(dir));
  return RunJournal(dir);
}

absl::Status RunJournal::AddRun(const v1::JournalRun& run) {
  const std::string folder = RunDir(run.run().run_id());
  if (PathExists(folder + "/" + kRunFile)) {
    // A run this coordinator could not restore (damaged, or its autosave missing): its
    // journal is the only record of it, and only an operator may remove it.
    LORASTEP_LOG(Error) << "journal: " << folder << " holds a run that was not restored; CreateRun of its id refused";
    return absl::FailedPreconditionError(
        "run_id: a journaled run of this id was not restored (see the coordinator's log); an operator must repair "
        "or remove its journal before the id is used again");
  }
  LORASTEP_RETURN_IF_ERROR(RemoveAll(folder));  // an unfinished creation's leftovers (no run.pb)
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(folder));
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(folder + "/" + kJournalFile, std::string(kFileMagic)));
  // run.pb last: a folder without it is an unfinished creation, skipped by Recover.
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(folder + "/" + kRunFile, absl::StrCat(kFileMagic, Framed(run))));
  return SyncDirectory(dir_);
}

absl::Status RunJournal::Append(const std::string& run_id, const v1::JournalEntry& entry, bool sync) {
  const std::string path = RunDir(run_id) + "/" + kJournalFile;
  const int fd = open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return ErrnoError("open", path);
  const std::string record = Framed(entry);
  std::lock_guard<std::mutex> lock(*append_mu_);
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t n = write(fd, record.data() + done, record.size() - done);
    if (n < 0) {
      absl::Status s = ErrnoError("write", path);
      close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (sync && fdatasync(fd) != 0) {
    absl::Status s = ErrnoError("fdatasync", path);
    close(fd);
    return s;
  }
  if (close(fd) != 0) return ErrnoError("close", path);
  return absl::OkStatus();
}

absl::Status RunJournal::RemoveRun(const std::string& run_id) { return RemoveAll(RunDir(run_id)); }

absl::StatusOr<JournaledRun> RunJournal::RecoverRun(const std::string& name) {
  v1::JournalRun created_run;
  const std::string run_file = RunDir(name) + "/" + kRunFile;
  auto created = ReadFileToString(run_file);
  if (!created.ok() || created->size() < kFileMagic.size() ||
      absl::string_view(*created).substr(0, kFileMagic.size()) != kFileMagic ||
      IntactRecordAt(*created, kFileMagic.size(), &created_run) != created->size() - kFileMagic.size() ||
      created_run.run().run_id() != name) {
    return absl::DataLossError(
        absl::StrCat(run_file, ": damaged (no intact journaled run: wrong header, checksum or id); not restored"));
  }
  const std::string path = RunDir(name) + "/" + kJournalFile;
  LORASTEP_ASSIGN_OR_RETURN(const std::string data, ReadFileToString(path));
  ParsedFile parsed = ParseJournal(data);
  if (parsed.damage == ParsedFile::Damage::kDamaged) {
    // Cutting here would roll the run back silently and forget applied request ids.
    return absl::DataLossError(absl::StrCat(
        path, ": damaged at byte ", parsed.damage_at,
        parsed.damage_at == 0 ? " (no journal header)" : " (a record fails its checksum, intact records follow)",
        "; the run is not restored and its files are left as they are"));
  }
  if (parsed.damage == ParsedFile::Damage::kTornTail) {
    LORASTEP_LOG(Warning) << "journal: " << path << ": a torn last record at byte " << parsed.damage_at << " of "
                          << data.size() << " (a write cut short) is dropped";
  }
  const std::vector<v1::JournalEntry> all = std::move(parsed.records);
  std::set<std::string> done;  // background autosaves that became durable
  for (const auto& e : all) {
    if (!e.autosave_done().empty()) done.insert(e.autosave_done());
  }
  size_t keep = 0, newest_marker = 0;  // entries up to the last durable marker, and up to the last marker
  for (size_t i = 0; i < all.size(); ++i) {
    if (!all[i].autosave_marker()) continue;
    newest_marker = i + 1;
    if (!all[i].autosave_pending() || done.count(all[i].autosave_name())) keep = i + 1;
  }
  JournaledRun r = CutAt(created_run, all, keep);
  // A torn tail may have been the record that made the newest autosave durable (the one
  // before it is then removed already): that autosave is the run's fallback.
  if (parsed.damage == ParsedFile::Damage::kTornTail && newest_marker > keep) {
    r.newer_pending = std::make_shared<JournaledRun>(CutAt(created_run, all, newest_marker));
  }
  return r;
}

absl::Status RunJournal::Settle(const JournaledRun& restored) {
  const std::string path = RunDir(restored.created.run().run_id()) + "/" + kJournalFile;
  LORASTEP_ASSIGN_OR_RETURN(const std::string data, ReadFileToString(path));
  // The file then says exactly what was restored (temp + rename: never half rewritten).
  const std::string rewritten = JournalFileOf(restored.entries);
  if (rewritten == data) return absl::OkStatus();
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(path + ".tmp", rewritten));
  if (rename((path + ".tmp").c_str(), path.c_str()) != 0) return ErrnoError("rename", path);
  return SyncDirectory(RunDir(restored.created.run().run_id()));
}

absl::StatusOr<std::vector<JournaledRun>> RunJournal::Recover(std::vector<absl::Status>* skipped) {
  std::vector<std::string> names;
  DIR* d = opendir(dir_.c_str());
  if (d == nullptr) return ErrnoError("opendir", dir_);
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != ".." && PathExists(RunDir(name) + "/" + kRunFile)) names.push_back(name);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  std::vector<JournaledRun> out;
  for (const std::string& name : names) {
    auto r = RecoverRun(name);
    if (r.ok()) {
      out.push_back(std::move(r).value());
    } else {
      skipped->push_back(r.status());
    }
  }
  return out;
}

}  // namespace lorastep
