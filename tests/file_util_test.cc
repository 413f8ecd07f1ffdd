#include "lib/io/file_util.h"

#include <dirent.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>

#include "lib/io/checkpoint_dir.h"
#include "lib/io/state_store.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

TEST(FileUtilTest, MakeAndRemoveNestedFolders) {
  const std::string dir = ScratchDir("fu_nested");
  ASSERT_OK(MakeDirectories(dir + "/a/b/c"));
  ASSERT_OK(WriteStringToFile(dir + "/a/b/c/f.txt", "x"));
  ASSERT_OK(MakeDirectories(dir + "/a/b/c"));  // existing is fine
  ASSERT_OK(RemoveAll(dir + "/a"));
  EXPECT_FALSE(PathExists(dir + "/a"));
  ASSERT_OK(RemoveAll(dir + "/a"));  // absent is fine
}

TEST(FileUtilTest, ErrorsNameThePath) {
  const std::string dir = ScratchDir("fu_err");
  ASSERT_OK(WriteStringToFile(dir + "/file", "x"));
  EXPECT_THAT(MakeDirectories(dir + "/file/sub"),
              StatusIs(absl::StatusCode::kNotFound, dir + "/file/sub: cannot create folder"));
  EXPECT_THAT(ReadFileToString(dir + "/none"), StatusIs(absl::StatusCode::kNotFound, "none"));
  EXPECT_THAT(FileWriter::Create(dir + "/missing/x"),
              StatusIs(absl::StatusCode::kNotFound, "cannot create"));
  EXPECT_THAT(SyncDirectory(dir + "/none"), StatusIs(absl::StatusCode::kNotFound, "cannot open folder"));
}

// A full disk is RESOURCE_EXHAUSTED (not INTERNAL), naming the path: /dev/full fails every
// write with ENOSPC.
TEST(FileUtilTest, FullDiskIsResourceExhausted) {
  if (!PathExists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  EXPECT_THAT(WriteStringToFile("/dev/full", "bytes"),
              StatusIs(absl::StatusCode::kResourceExhausted, "/dev/full: write failed: No space left on device"));
  EXPECT_THAT(WriteStringToFile("/nonexistent-folder/x", "bytes"),
              StatusIs(absl::StatusCode::kNotFound, "/nonexistent-folder/x: cannot create"));
}

TEST(FileUtilTest, ParentPath) {
  EXPECT_EQ(ParentPath("a/b/c"), "a/b");
  EXPECT_EQ(ParentPath("a/b/c/"), "a/b");
  EXPECT_EQ(ParentPath("c"), ".");
  EXPECT_EQ(ParentPath("/c"), "/");
}

TEST(CheckpointDirTest, ReplacesAtomicallyAndSurvivesFaults) {
  const std::string dir = ScratchDir("ckdir");
  auto writer = [](const std::string& text) {
    return [text](const std::string& tmp) { return WriteStringToFile(tmp + "/v", text); };
  };
  ASSERT_OK(WriteFolderAtomically(dir + "/ck", writer("one")));
  EXPECT_EQ(ReadFileToString(dir + "/ck/v").value(), "one");
  auto crash = [](const std::string& stage) -> absl::Status {
    return stage == "before_swap" ? absl::AbortedError("crash") : absl::OkStatus();
  };
  EXPECT_THAT(WriteFolderAtomically(dir + "/ck", writer("two"), crash),
              StatusIs(absl::StatusCode::kAborted, "crash"));
  EXPECT_EQ(ReadFileToString(dir + "/ck/v").value(), "one");
  ASSERT_OK(WriteFolderAtomically(dir + "/ck/", writer("three")));
  EXPECT_EQ(ReadFileToString(dir + "/ck/v").value(), "three");
  EXPECT_THAT(WriteFolderAtomically(dir + "/ck", [](const std::string&) {
                return absl::InternalError("disk full");
              }),
              StatusIs(absl::StatusCode::kInternal, "disk full"));
  EXPECT_EQ(ReadFileToString(dir + "/ck/v").value(), "three");
}

// Defects from issue 8: a save onto an existing folder deleted its contents, onto a file
// replaced it, and a failed save left its temp folder. Now lorastep replaces only absent
// paths, empty folders and folders carrying its marker; failures leave nothing behind.
TEST(CheckpointDirTest, NeverReplacesWhatLorastepDidNotWriteAndCleansUpFailures) {
  const std::string dir = ScratchDir("ckown");
  auto writer = [](const std::string& tmp) { return WriteStringToFile(tmp + "/v", "x"); };
  ASSERT_OK(MakeDirectories(dir + "/user"));
  ASSERT_OK(WriteStringToFile(dir + "/user/thesis.tex", "precious"));
  EXPECT_THAT(WriteFolderAtomically(dir + "/user", writer),
              StatusIs(absl::StatusCode::kFailedPrecondition, "was not written by lorastep"));
  EXPECT_EQ(ReadFileToString(dir + "/user/thesis.tex").value(), "precious");
  ASSERT_OK(WriteStringToFile(dir + "/notes.txt", "also precious"));
  EXPECT_THAT(WriteFolderAtomically(dir + "/notes.txt", writer),
              StatusIs(absl::StatusCode::kFailedPrecondition, "is not a folder"));
  EXPECT_EQ(ReadFileToString(dir + "/notes.txt").value(), "also precious");
  ASSERT_OK(MakeDirectories(dir + "/empty"));
  ASSERT_OK(WriteFolderAtomically(dir + "/empty", writer));  // an empty folder holds nothing
  EXPECT_TRUE(PathExists(dir + "/empty/" + std::string(kFolderMarker)));
  ASSERT_OK(WriteFolderAtomically(dir + "/empty", writer));  // ours now: replaceable
  // A failed write removes its temporary folder; the target keeps its previous contents.
  EXPECT_THAT(WriteFolderAtomically(dir + "/empty", [](const std::string& tmp) {
                if (!WriteStringToFile(tmp + "/partial", "half").ok()) return absl::InternalError("setup");
                return absl::ResourceExhaustedError("disk full");
              }),
              StatusIs(absl::StatusCode::kResourceExhausted, "disk full"));
  EXPECT_EQ(ReadFileToString(dir + "/empty/v").value(), "x");
  EXPECT_FALSE(WriteFolderAtomically("/dev/full/x", writer).ok());  // no folder can be made there
  DIR* d = opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* e = readdir(d)) EXPECT_EQ(std::string(e->d_name).find(".tmp-"), std::string::npos) << e->d_name;
  closedir(d);
}

// The state store: references resolve under the root, names cannot escape it, plain paths
// are refused when a store is configured (and references when none is), and only folders
// lorastep wrote are listed and deleted.
// The store's TTL: lorastep folders whose newest file is older than the TTL go; newer ones,
// foreign folders and other runs' fresh folders stay.
TEST(StateStoreTest, PruneRemovesOnlyExpiredLorastepFolders) {
  const std::string root = ScratchDir("store_ttl");
  ASSERT_OK_AND_ASSIGN(StateStore store, StateStore::Open(root));
  auto write = [&](const std::string& ref) {
    ASSERT_OK_AND_ASSIGN(std::string path, store.Resolve(ref, "path"));
    ASSERT_OK(WriteFolderAtomically(path, [](const std::string& tmp) { return WriteStringToFile(tmp + "/w", "1"); }));
  };
  write("lorastep://run-1/old");
  write("lorastep://run-1/new");
  write("lorastep://run-2/old");
  ASSERT_OK(MakeDirectories(root + "/runs/run-1/foreign"));
  ASSERT_OK(WriteStringToFile(root + "/runs/run-1/foreign/f", "x"));
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  // Age the "old" folders and the foreign one by two days (every entry: the newest counts).
  for (const std::string& dir : {root + "/runs/run-1/old", root + "/runs/run-2/old", root + "/runs/run-1/foreign"}) {
    const struct timeval old_times[2] = {{now - 2 * 86400, 0}, {now - 2 * 86400, 0}};
    for (const std::string& p : {dir + "/w", dir + "/f", dir + "/.lorastep", dir}) utimes(p.c_str(), old_times);
  }
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> removed, store.PruneOlderThan(86400, now));
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<std::string>{"lorastep://run-1/old", "lorastep://run-2/old"}));
  EXPECT_EQ(store.List("run-1").value().size(), 1u);
  EXPECT_TRUE(PathExists(root + "/runs/run-1/foreign/f")) << "not lorastep's: never removed";
  EXPECT_TRUE(store.PruneOlderThan(86400, now).value().empty());
}

TEST(StateStoreTest, ReferencesStayUnderTheRootAndOnlyLorastepFoldersAreListedOrDeleted) {
  const std::string root = ScratchDir("store");
  ASSERT_OK_AND_ASSIGN(StateStore store, StateStore::Open(root));
  ASSERT_OK_AND_ASSIGN(std::string ck, store.Resolve("lorastep://run-1/step-10", "path"));
  EXPECT_EQ(ck, root + "/runs/run-1/step-10");
  for (const char* bad : {"lorastep://run-1/../x", "lorastep://../etc/passwd", "lorastep://run-1/a/b",
                          "lorastep://run-1/.hidden", "lorastep://run-1/", "lorastep://run-1", "/tmp/x",
                          "run-1/x", "lorastep://run 1/x"}) {
    EXPECT_THAT(store.Resolve(bad, "path"), StatusIs(absl::StatusCode::kInvalidArgument, "path")) << bad;
  }
  EXPECT_THAT(ValidateStoreName(std::string(129, 'a'), "run_id"),
              StatusIs(absl::StatusCode::kInvalidArgument, "run_id: 129 bytes"));
  // Issue 26, defect 8: the pattern of lorastep's temporary folders is not a name, and a
  // symbolic link in the store (runs/<run> or the named folder) leads nowhere.
  EXPECT_THAT(store.Resolve("lorastep://run-1/ck.tmp-abc", "path"),
              StatusIs(absl::StatusCode::kInvalidArgument, "path (name): must not contain '.tmp-'"));
  const std::string outside = ScratchDir("store_outside");
  ASSERT_EQ(symlink(outside.c_str(), (root + "/runs/linked").c_str()), 0);
  EXPECT_THAT(store.Resolve("lorastep://linked/ck", "path"),
              StatusIs(absl::StatusCode::kFailedPrecondition, "passes through a symbolic link"));
  ASSERT_OK(MakeDirectories(root + "/runs/run-2"));
  ASSERT_EQ(symlink(outside.c_str(), (root + "/runs/run-2/ck").c_str()), 0);
  EXPECT_THAT(store.Resolve("lorastep://run-2/ck", "path"),
              StatusIs(absl::StatusCode::kFailedPrecondition, "passes through a symbolic link"));
  EXPECT_THAT(ValidateStoreName(std::string("a\0b", 3), "run_id"),
              StatusIs(absl::StatusCode::kInvalidArgument, "run_id: only letters"));
  EXPECT_THAT(ResolveRequestPath(&store, "/etc", "path"), StatusIs(absl::StatusCode::kInvalidArgument, "reference"));
  EXPECT_THAT(ResolveRequestPath(nullptr, "lorastep://r/n", "path"),
              StatusIs(absl::StatusCode::kInvalidArgument, "--allow_plain_paths"));
  EXPECT_EQ(ResolveRequestPath(nullptr, "/some/where", "path").value(), "/some/where");
  EXPECT_EQ(ResolveRequestPath(nullptr, "/some/where/", "path").value(), "/some/where/");
  // Without a store, a plain path must name its folder plainly: absolute, no "." or ".."
  // components, no NUL byte, at most 4096 bytes.
  for (const std::string& bad : {std::string("some/where"), std::string("./x"), std::string("../x"),
                                 std::string("/tmp/../etc"), std::string("/tmp/./x"), std::string("/tmp/x/.."),
                                 std::string("/tmp/a\0b", 8), "/" + std::string(4096, 'a')}) {
    EXPECT_THAT(ResolveRequestPath(nullptr, bad, "path"), StatusIs(absl::StatusCode::kInvalidArgument, "path: "))
        << bad;
  }
  EXPECT_THAT(ResolveRequestPath(nullptr, "../x", "init_from"),
              StatusIs(absl::StatusCode::kInvalidArgument, "init_from: '../x' is relative"));
  EXPECT_THAT(ResolveRequestPath(nullptr, "/tmp/../etc", "path"),
              StatusIs(absl::StatusCode::kInvalidArgument, "has a '..' component"));

  ASSERT_OK(WriteFolderAtomically(ck, [](const std::string& tmp) { return WriteStringToFile(tmp + "/w", "12345"); }));
  ASSERT_OK(MakeDirectories(root + "/runs/run-1/foreign"));
  ASSERT_OK(WriteStringToFile(root + "/runs/run-1/foreign/f", "x"));
  ASSERT_OK_AND_ASSIGN(auto listed, store.List("run-1"));
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].name, "step-10");
  EXPECT_EQ(listed[0].ref, "lorastep://run-1/step-10");
  EXPECT_GE(listed[0].bytes, 5);
  EXPECT_GT(listed[0].modified_unix_s, 0);
  EXPECT_TRUE(store.List("never-created").value().empty());
  EXPECT_THAT(store.Delete("run-1", "foreign"), StatusIs(absl::StatusCode::kFailedPrecondition, "not written by lorastep"));
  EXPECT_TRUE(PathExists(root + "/runs/run-1/foreign/f"));
  EXPECT_THAT(store.Delete("run-1", "nope"), StatusIs(absl::StatusCode::kNotFound, "does not exist"));
  EXPECT_THAT(store.Delete("run-1", ".."), StatusIs(absl::StatusCode::kInvalidArgument, "name"));
  ASSERT_OK(store.Delete("run-1", "step-10"));
  EXPECT_FALSE(PathExists(ck));
  EXPECT_TRUE(store.List("run-1").value().empty());
}

// The root a server keeps its state under: --state_dir, else $XDG_STATE_HOME/lorastep,
// else ~/.local/state/lorastep, else /tmp/lorastep-state-<uid>; none only with
// --allow_plain_paths, which together with a --state_dir is refused naming the flag.
TEST(StateStoreTest, ServerStateDirDefaultsToAStoreAndPlainPathsAreAnOptIn) {
  const char* xdg = std::getenv("XDG_STATE_HOME");
  const char* home = std::getenv("HOME");
  const std::string saved_xdg = xdg != nullptr ? xdg : "", saved_home = home != nullptr ? home : "";
  ASSERT_EQ(setenv("XDG_STATE_HOME", "/srv/state", 1), 0);
  EXPECT_EQ(DefaultStateDir(), "/srv/state/lorastep");
  ASSERT_EQ(setenv("XDG_STATE_HOME", "relative", 1), 0);  // not absolute: ignored
  ASSERT_EQ(setenv("HOME", "/home/u", 1), 0);
  EXPECT_EQ(DefaultStateDir(), "/home/u/.local/state/lorastep");
  ASSERT_EQ(unsetenv("XDG_STATE_HOME"), 0);
  ASSERT_EQ(unsetenv("HOME"), 0);
  EXPECT_EQ(DefaultStateDir(), "/tmp/lorastep-state-" + std::to_string(getuid()));
  EXPECT_EQ(ServerStateDir("", false).value(), DefaultStateDir());
  EXPECT_EQ(ServerStateDir("/data/store", false).value(), "/data/store");
  EXPECT_EQ(ServerStateDir("", true).value(), "");
  EXPECT_THAT(ServerStateDir("/data/store", true), StatusIs(absl::StatusCode::kInvalidArgument, "allow_plain_paths"));
  if (!saved_xdg.empty()) setenv("XDG_STATE_HOME", saved_xdg.c_str(), 1);
  if (!saved_home.empty()) setenv("HOME", saved_home.c_str(), 1);
}

}  // namespace
}  // namespace lorastep
