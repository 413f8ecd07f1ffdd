// The coordinator's journal of runs (--journal_dir), so a restarted coordinator brings its
// runs back: per run, a folder holding run.pb (how it was created) and `journal`, an
// append-only file of length-prefixed JournalEntry records — one per applied mutating call,
// written before the call's response leaves, and a marker at each autosave of the workers'
// state (lorastep://<run>/autosave-<n>). A marker written when an autosave starts in the
// background is pending until a later record says that autosave is durable.
//
// On restart a run comes back as it was at its last durable marker (its autosave): sequence
// id, learner version, step history and request records up to there; later entries (the
// gradients of ForwardBackward calls since the last step, a step whose autosave did not
// finish) are dropped from the file once the run is restored (Settle).
//
// Integrity: each file starts with a header, and every record carries its length, a CRC-32C
// and a format version. A torn last record (a crash mid-append: nothing intact after it) is
// dropped with a warning naming the file. Any other damage (a missing header, a bad record
// with intact ones after it, a damaged run.pb) is DATA_LOSS naming the file: the run is not
// restored, its files stay as they are, and CreateRun of its id is refused until an operator
// repairs or removes them. Recovery never cuts a damaged journal back silently.
#ifndef LORASTEP_SERVER_RUN_JOURNAL_H_
#define LORASTEP_SERVER_RUN_JOURNAL_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lorastep/v1/journal.pb.h"

namespace lorastep {

struct JournaledRun {
  v1::JournalRun created;
  // The entries up to and including the last autosave marker (none: back to creation).
  std::vector<v1::JournalEntry> entries;
  // The run as of the last durable marker (created.run when there is none).
  v1::Run run;
  bool autosaved = false;
  std::string autosave_name;  // that marker's checkpoint name
  // After a torn last record: the run as of the newest autosave marker, still pending in the
  // file (the torn record may have been the one that made it durable). Restore falls back to
  // it when the durable marker's autosave is gone. Null otherwise.
  std::shared_ptr<JournaledRun> newer_pending;

};

class RunJournal {
 public:
  // Creates `dir` if needed.
  static absl::StatusOr<RunJournal> Open(const std::string& dir);

  // FAILED_PRECONDITION when a journaled run of that id exists (one that was not restored).
  absl::Status AddRun(const v1::JournalRun& run);
  // Appends one record; `sync`: fsync before returning (durable autosave markers). Safe
  // from several threads.
  absl::Status Append(const std::string& run_id, const v1::JournalEntry& entry, bool sync);
  absl::Status RemoveRun(const std::string& run_id);
  // Every journaled run, each cut back to its last durable marker; the files are not
  // changed (Settle does that once a run is restored).
  // A run whose files cannot be read is left in place and reported in `skipped`.
  absl::StatusOr<std::vector<JournaledRun>> Recover(std::vector<absl::Status>* skipped);
  // One run, the same way (the caller keeps other calls of the run from appending meanwhile).
  absl::StatusOr<JournaledRun> RecoverRun(const std::string& run_id);
  // Rewrites the run's journal to say exactly what was restored: `restored`'s entries, its
  // marker durable. Before any new record of the run is appended.
  absl::Status Settle(const JournaledRun& restored);

  const std::string& dir() const { return dir_; }

 private:
  explicit RunJournal(std::string dir) : dir_(std::move(dir)), append_mu_(std::make_unique<std::mutex>()) {}
  std::string RunDir(const std::string& run_id) const { return dir_ + "/" + run_id; }
  std::string dir_;
  std::unique_ptr<std::mutex> append_mu_;  // a record is written whole before the next starts
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_RUN_JOURNAL_H_
