// WriteTarArchive against the system's tar: what it lists and extracts is the folder, byte
// for byte; the same folder gives the same archive; what cannot be archived is refused.
#include "lib/io/tar_archive.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "lib/io/file_util.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

absl::StatusOr<std::string> Archive(const std::string& folder, const std::string& prefix) {
  std::string out;
  absl::Status s = WriteTarArchive(folder, prefix, [&](absl::string_view bytes) {
    out.append(bytes.data(), bytes.size());
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return out;
}

TEST(TarArchiveTest, SystemTarExtractsTheFolderByteForByte) {
  const std::string dir = ScratchDir("tar");
  const std::string folder = dir + "/peft";
  const std::string deep = std::string(60, 'd'), file = std::string(70, 'f') + ".bin";
  ASSERT_EQ(mkdir(folder.c_str(), 0755), 0);
  ASSERT_EQ(mkdir((folder + "/" + deep).c_str(), 0755), 0);
  const std::string config = R"({"r": 8, "lora_alpha": 16})";
  const std::string weights = RandomBytes(1000, 1), odd = RandomBytes(513, 2), empty;
  ASSERT_OK(WriteStringToFile(folder + "/adapter_config.json", config));
  ASSERT_OK(WriteStringToFile(folder + "/adapter_model.safetensors", weights));
  ASSERT_OK(WriteStringToFile(folder + "/" + deep + "/" + file, odd));  // 8 + 60 + 1 + 74 bytes: a split name
  ASSERT_OK(WriteStringToFile(folder + "/empty", empty));
  ASSERT_OK(WriteStringToFile(folder + "/.lorastep", "marker"));  // hidden: left out
  ASSERT_OK(WriteStringToFile(folder + "/" + deep + "/.hidden", "x"));
  ASSERT_OK_AND_ASSIGN(std::string archive, Archive(folder, "adapter"));
  EXPECT_EQ(archive.size() % 512, 0u);
  ASSERT_OK_AND_ASSIGN(std::string again, Archive(folder, "adapter"));
  EXPECT_EQ(archive, again) << "the same folder gives the same bytes";
  ASSERT_OK(WriteStringToFile(dir + "/a.tar", archive));
  ASSERT_EQ(mkdir((dir + "/out").c_str(), 0755), 0);
  ASSERT_EQ(std::system(("tar -tf " + dir + "/a.tar > " + dir + "/list.txt").c_str()), 0);
  ASSERT_OK_AND_ASSIGN(std::string list, ReadFileToString(dir + "/list.txt"));
  EXPECT_EQ(list, "adapter/\nadapter/adapter_config.json\nadapter/adapter_model.safetensors\nadapter/" + deep + "/\nadapter/" +
                      deep + "/" + file + "\nadapter/empty\n");
  ASSERT_EQ(std::system(("tar -xf " + dir + "/a.tar -C " + dir + "/out").c_str()), 0);
  const std::string out = dir + "/out/adapter/";
  EXPECT_EQ(ReadFileToString(out + "adapter_config.json").value_or("?"), config);
  EXPECT_EQ(ReadFileToString(out + "adapter_model.safetensors").value_or("?"), weights);
  EXPECT_EQ(ReadFileToString(out + deep + "/" + file).value_or("?"), odd);
  EXPECT_EQ(ReadFileToString(out + "empty").value_or("?"), empty);
  // No prefix: the folder's entries at the archive's root.
  ASSERT_OK_AND_ASSIGN(std::string bare, Archive(folder, ""));
  ASSERT_OK(WriteStringToFile(dir + "/b.tar", bare));
  ASSERT_EQ(std::system(("tar -tf " + dir + "/b.tar | head -1 > " + dir + "/first.txt").c_str()), 0);
  EXPECT_EQ(ReadFileToString(dir + "/first.txt").value_or("?"), "adapter_config.json\n");
  // Files from memory come after the folder's, as if they were in it.
  std::string with_extra;
  ASSERT_OK(WriteTarArchive(
      folder, "",
      [&](absl::string_view bytes) {
        with_extra.append(bytes.data(), bytes.size());
        return absl::OkStatus();
      },
      {{"checkpoint_complete", ""}, {"note.txt", odd}}));
  ASSERT_OK(WriteStringToFile(dir + "/c.tar", with_extra));
  ASSERT_EQ(mkdir((dir + "/out_c").c_str(), 0755), 0);
  ASSERT_EQ(std::system(("tar -tf " + dir + "/c.tar | tail -2 > " + dir + "/last.txt && tar -xf " + dir +
                         "/c.tar -C " + dir + "/out_c").c_str()),
            0);
  EXPECT_EQ(ReadFileToString(dir + "/last.txt").value_or("?"), "checkpoint_complete\nnote.txt\n");
  EXPECT_EQ(ReadFileToString(dir + "/out_c/note.txt").value_or("?"), odd);
  EXPECT_EQ(ReadFileToString(dir + "/out_c/checkpoint_complete").value_or("?"), "");
}

TEST(TarArchiveTest, RefusesLinksMissingFoldersAndPassesTheSinksError) {
  const std::string dir = ScratchDir("tar_refusals");
  const std::string folder = dir + "/peft";
  ASSERT_EQ(mkdir(folder.c_str(), 0755), 0);
  ASSERT_OK(WriteStringToFile(folder + "/adapter_config.json", "{}"));
  ASSERT_EQ(symlink("/etc/passwd", (folder + "/secret").c_str()), 0);
  EXPECT_THAT(Archive(folder, "adapter").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "'adapter/secret' is a symbolic link"));
  EXPECT_THAT(Archive(dir + "/nothing", "").status(), StatusIs(absl::StatusCode::kNotFound, "nothing"));
  EXPECT_THAT(Archive(folder + "/adapter_config.json", "").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "is not a folder"));
  ASSERT_EQ(unlink((folder + "/secret").c_str()), 0);
  int calls = 0;
  absl::Status s = WriteTarArchive(folder, "adapter", [&](absl::string_view) {
    return ++calls == 2 ? absl::UnavailableError("client went away") : absl::OkStatus();
  });
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, "client went away"));
  EXPECT_EQ(calls, 2) << "nothing more is written after the sink's error";
  // A name that no split fits: one component longer than 100 bytes.
  ASSERT_OK(WriteStringToFile(folder + "/" + std::string(101, 'x'), "1"));
  EXPECT_THAT(Archive(folder, "").status(), StatusIs(absl::StatusCode::kFailedPrecondition, "too long for a tar header"));
}

}  // namespace
}  // namespace lorastep
