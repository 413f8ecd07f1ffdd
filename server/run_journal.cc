#include "server/run_journal.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <set>

#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {

constexpr const char* kRunFile = "run.pb";
constexpr const char* kJournalFile = "journal";

// A record: its length (4 bytes, little-endian), then the serialized entry.
std::string Framed(const v1::JournalEntry& entry) {
  const std::string body = entry.SerializeAsString();
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + body;
}

// The complete records of a journal file; a torn or unparsable tail ends the list.
std::vector<v1::JournalEntry> ParseRecords(const std::string& data) {
  std::vector<v1::JournalEntry> out;
  size_t at = 0;
  while (at + 4 <= data.size()) {
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<unsigned char>(data[at + i])) << (8 * i);
    if (at + 4 + n > data.size()) break;
    v1::JournalEntry e;
    if (!e.ParseFromArray(data.data() + at + 4, static_cast<int>(n))) break;
    out.push_back(std::move(e));
    at += 4 + n;
  }
  return out;
}

}  // namespace

absl::StatusOr<RunJournal> RunJournal::Open(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("journal_dir: empty");
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(dir));
  return RunJournal(dir);
}

absl::Status RunJournal::AddRun(const v1::JournalRun& run) {
  const std::string folder = RunDir(run.run().run_id());
  LORASTEP_RETURN_IF_ERROR(RemoveAll(folder));  // a deleted run's leftovers, never another live run's
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(folder));
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(folder + "/" + kJournalFile, ""));
  // run.pb last: a folder without it is an unfinished creation, skipped by Recover.
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(folder + "/" + kRunFile, run.SerializeAsString()));
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
  JournaledRun r;
  auto created = ReadFileToString(RunDir(name) + "/" + kRunFile);
  if (!created.ok() || !r.created.ParseFromString(*created) || r.created.run().run_id() != name) {
    return absl::DataLossError(absl::StrCat(RunDir(name), "/", kRunFile, ": not a journaled run"));
  }
  const std::string path = RunDir(name) + "/" + kJournalFile;
  LORASTEP_ASSIGN_OR_RETURN(const std::string data, ReadFileToString(path));
  std::vector<v1::JournalEntry> all = ParseRecords(data);
  std::set<std::string> done;  // background autosaves that became durable
  for (const auto& e : all) {
    if (!e.autosave_done().empty()) done.insert(e.autosave_done());
  }
  size_t keep = 0;  // entries up to the last durable marker
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].autosave_marker() && (!all[i].autosave_pending() || done.count(all[i].autosave_name()))) keep = i + 1;
  }
  r.autosaved = keep > 0;
  r.run = r.autosaved ? all[keep - 1].run() : r.created.run();
  r.autosave_name = !r.autosaved ? "" : all[keep - 1].autosave_name().empty() ? "autosave" : all[keep - 1].autosave_name();
  all.resize(keep);
  // What is kept says it all by itself: the marker durable, no done records.
  if (r.autosaved) all.back().set_autosave_pending(false);
  all.erase(std::remove_if(all.begin(), all.end(), [](const v1::JournalEntry& e) { return !e.autosave_done().empty(); }),
            all.end());
  // The file now says exactly what was recovered (temp + rename: never half rewritten).
  std::string rewritten;
  for (const auto& e : all) rewritten += Framed(e);
  if (rewritten.size() != data.size()) {
    LORASTEP_RETURN_IF_ERROR(WriteStringToFile(path + ".tmp", rewritten));
    if (rename((path + ".tmp").c_str(), path.c_str()) != 0) return ErrnoError("rename", path);
  }
  r.entries = std::move(all);
  return r;
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
