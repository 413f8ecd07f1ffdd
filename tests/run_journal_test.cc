// The journal's integrity (server/run_journal.h) on real files: a torn last record is dropped,
// any other damage is DATA_LOSS naming the file and leaves the files as they were, and
// CreateRun never replaces the journal of a run that was not restored.
#include "server/run_journal.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "lib/io/crc32c.h"
#include "lib/io/file_util.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

v1::JournalEntry Call(const std::string& id, int64_t version) {
  v1::JournalEntry e;
  e.set_request_id(id);
  e.set_method("TrainStep");
  e.mutable_run()->set_learner_version(version);
  return e;
}

v1::JournalEntry Marker(const std::string& name, int64_t version) {
  v1::JournalEntry e = Call("", version);
  e.set_method("");
  e.set_autosave_marker(true);
  e.set_autosave_name(name);
  return e;
}

// A journal of run "r": steps 1..3, each followed by its (durable) autosave marker.
RunJournal JournalWithThreeSteps(const std::string& dir) {
  RunJournal journal = RunJournal::Open(dir).value();
  v1::JournalRun created;
  created.mutable_run()->set_run_id("r");
  EXPECT_TRUE(journal.AddRun(created).ok());
  for (int v = 1; v <= 3; ++v) {
    EXPECT_TRUE(journal.Append("r", Call("s" + std::to_string(v), v), false).ok());
    EXPECT_TRUE(journal.Append("r", Marker("autosave-" + std::to_string(v), v), true).ok());
  }
  return journal;
}

TEST(Crc32cTest, KnownValues) {
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("6789", Crc32c("12345")), Crc32c("123456789"));  // continues
}

TEST(RunJournalIntegrityTest, IntactJournalComesBackWhole) {
  const std::string dir = ScratchDir("journal_intact");
  RunJournal journal = JournalWithThreeSteps(dir);
  ASSERT_OK_AND_ASSIGN(JournaledRun r, journal.RecoverRun("r"));
  EXPECT_EQ(r.autosave_name, "autosave-3");
  EXPECT_EQ(r.run.learner_version(), 3);
  EXPECT_EQ(r.entries.size(), 6u);
}

TEST(RunJournalIntegrityTest, TornLastRecordIsDroppedAndTheRunComesBackAtItsLastMarker) {
  const std::string dir = ScratchDir("journal_torn");
  RunJournal journal = JournalWithThreeSteps(dir);
  ASSERT_OK(journal.Append("r", Call("s4", 4), false));
  const std::string path = dir + "/r/journal";
  ASSERT_OK_AND_ASSIGN(std::string data, ReadFileToString(path));
  ASSERT_OK(WriteStringToFile(path, data.substr(0, data.size() - 7)));  // s4 cut short
  ASSERT_OK_AND_ASSIGN(JournaledRun r, journal.RecoverRun("r"));
  EXPECT_EQ(r.autosave_name, "autosave-3");
  EXPECT_EQ(r.run.learner_version(), 3);
  ASSERT_OK(journal.Settle(r));
  ASSERT_OK_AND_ASSIGN(JournaledRun again, journal.RecoverRun("r"));  // the file was rewritten whole
  EXPECT_EQ(again.entries.size(), 6u);
  EXPECT_EQ(again.newer_pending, nullptr);
}

// The "last 7 bytes cut" case: the torn record was the one that made the newest background
// autosave durable, and the autosave before it is removed once a newer one is durable. The run
// falls back to the newer autosave (the coordinator uses it when the older one is gone), and
// Settle makes the file say what was restored.
TEST(RunJournalIntegrityTest, TornDurableRecordLeavesTheNewerAutosaveAsFallback) {
  const std::string dir = ScratchDir("journal_torn_done");
  RunJournal journal = JournalWithThreeSteps(dir);
  v1::JournalEntry pending = Marker("autosave-4", 4);
  pending.set_autosave_pending(true);
  v1::JournalEntry done;
  done.set_autosave_done("autosave-4");
  ASSERT_OK(journal.Append("r", Call("s4", 4), false));
  ASSERT_OK(journal.Append("r", pending, false));
  ASSERT_OK(journal.Append("r", done, true));
  const std::string path = dir + "/r/journal";
  ASSERT_OK_AND_ASSIGN(std::string data, ReadFileToString(path));
  ASSERT_OK(WriteStringToFile(path, data.substr(0, data.size() - 7)));
  ASSERT_OK_AND_ASSIGN(JournaledRun r, journal.RecoverRun("r"));
  EXPECT_EQ(r.autosave_name, "autosave-3");
  ASSERT_NE(r.newer_pending, nullptr);
  EXPECT_EQ(r.newer_pending->autosave_name, "autosave-4");
  EXPECT_EQ(r.newer_pending->run.learner_version(), 4);
  EXPECT_EQ(ReadFileToString(path).value(), data.substr(0, data.size() - 7)) << "recovery alone changes no file";
  ASSERT_OK(journal.Settle(*r.newer_pending));
  ASSERT_OK_AND_ASSIGN(JournaledRun settled, journal.RecoverRun("r"));
  EXPECT_EQ(settled.autosave_name, "autosave-4");
  EXPECT_EQ(settled.newer_pending, nullptr);
  EXPECT_EQ(settled.entries.size(), 8u);
  // Without a torn tail a pending marker is only a write in progress: no fallback.
  ASSERT_OK(journal.Append("r", Call("s5", 5), false));
  pending.set_autosave_name("autosave-5");
  ASSERT_OK(journal.Append("r", pending, false));
  ASSERT_OK_AND_ASSIGN(JournaledRun later, journal.RecoverRun("r"));
  EXPECT_EQ(later.autosave_name, "autosave-4");
  EXPECT_EQ(later.newer_pending, nullptr);
}

// Each damage that used to roll the run back silently (or lose it) is DATA_LOSS naming the
// file, and the files are left exactly as they were.
TEST(RunJournalIntegrityTest, DamageIsDataLossNamingTheFileAndChangesNothing) {
  struct Case {
    const char* what;
    const char* file;
    std::function<std::string(const std::string&)> damage;
  };
  const std::vector<Case> cases = {
      {"truncated to zero", "journal", [](const std::string&) { return std::string(); }},
      {"random bytes", "journal", [](const std::string& d) { return std::string(d.size(), '\x5a'); }},
      {"16 bytes flipped mid-file", "journal",
       [](const std::string& d) {
         std::string out = d;
         for (size_t i = d.size() / 2; i < d.size() / 2 + 16; ++i) out[i] = static_cast<char>(~out[i]);
         return out;
       }},
      {"one bit flipped in the first record", "journal",
       [](const std::string& d) {
         std::string out = d;
         out[20] = static_cast<char>(out[20] ^ 1);
         return out;
       }},
      {"garbage run.pb", "run.pb", [](const std::string&) { return std::string("not a run"); }},
      {"run.pb one bit flipped", "run.pb",
       [](const std::string& d) {
         std::string out = d;
         out[out.size() - 1] = static_cast<char>(out.back() ^ 4);
         return out;
       }},
  };
  int index = 0, silent_rollbacks = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string dir = ScratchDir("journal_damage_" + std::to_string(index++));
    RunJournal journal = JournalWithThreeSteps(dir);
    const std::string path = dir + "/r/" + c.file;
    ASSERT_OK_AND_ASSIGN(std::string data, ReadFileToString(path));
    const std::string damaged = c.damage(data);
    ASSERT_OK(WriteStringToFile(path, damaged));
    auto r = journal.RecoverRun("r");
    if (r.ok()) ++silent_rollbacks;
    EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kDataLoss, path));
    std::vector<absl::Status> skipped;
    ASSERT_OK_AND_ASSIGN(std::vector<JournaledRun> all, journal.Recover(&skipped));
    EXPECT_TRUE(all.empty());
    ASSERT_EQ(skipped.size(), 1u);
    EXPECT_EQ(ReadFileToString(path).value(), damaged);  // left as it was
    // A new run of that id never replaces the damaged run's journal.
    v1::JournalRun created;
    created.mutable_run()->set_run_id("r");
    EXPECT_THAT(journal.AddRun(created), StatusIs(absl::StatusCode::kFailedPrecondition, "run_id: a journaled run"));
    EXPECT_EQ(ReadFileToString(path).value(), damaged);
  }
  // bench/reliability.sh reads this line (the torn-tail case above is the seventh).
  std::printf("journal_damage_cases=%zu journal_silent_rollbacks=%d\n", cases.size() + 1, silent_rollbacks);
  EXPECT_EQ(silent_rollbacks, 0);
}

}  // namespace
}  // namespace lorastep
