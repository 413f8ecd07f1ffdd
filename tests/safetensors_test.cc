#include "lib/io/safetensors.h"

#include <cstring>
#include <fstream>
#include <vector>

#include "lib/io/file_util.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

// Writes an arbitrary header (and `data_bytes` zero bytes) to make a hand-crafted file.
std::string WriteRaw(const std::string& path, const std::string& header, size_t data_bytes) {
  std::string bytes(8, '\0');
  uint64_t len = header.size();
  std::memcpy(bytes.data(), &len, 8);
  bytes += header;
  bytes += std::string(data_bytes, '\0');
  EXPECT_TRUE(WriteStringToFile(path, bytes).ok());
  return path;
}

TEST(SafetensorsTest, RoundTripKeepsNamesShapesBytesAndMetadata) {
  const std::string dir = ScratchDir("st_roundtrip");
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -1e-7f};
  std::vector<uint16_t> b = {0x3f80, 0xc000, 0x7f80};  // bf16 1, -2, inf
  std::vector<int64_t> c = {42};
  ASSERT_OK(WriteSafetensors(dir + "/x.safetensors",
                             {{"layer.a", DType::kF32, {2, 3}, a.data()},
                              {"layer.b", DType::kBF16, {3}, b.data()},
                              {"scalar", DType::kI64, {}, c.data()}},
                             {{"format", "pt"}}));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(dir + "/x.safetensors"));
  ASSERT_EQ(f.entries().size(), 3u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* ea, f.Find("layer.a"));
  EXPECT_EQ(ea->dtype, DType::kF32);
  EXPECT_EQ(ea->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(ea->data, a.data(), a.size() * 4), 0);
  ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* eb, f.Find("layer.b"));
  EXPECT_EQ(eb->dtype, DType::kBF16);
  EXPECT_EQ(std::memcmp(eb->data, b.data(), 6), 0);
  ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* ec, f.Find("scalar"));
  EXPECT_EQ(ec->numel(), 1);
  EXPECT_THAT(f.Find("nope"), StatusIs(absl::StatusCode::kNotFound, "'nope'"));
}

TEST(SafetensorsTest, TruncatedFileIsRejected) {
  const std::string dir = ScratchDir("st_trunc");
  WriteStringToFile(dir + "/short.safetensors", "abc").IgnoreError();
  EXPECT_THAT(SafetensorsFile::Open(dir + "/short.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "truncated"));
  // Data section shorter than the header promises: the error names the tensor.
  WriteRaw(dir + "/cut.safetensors",
           R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  EXPECT_THAT(SafetensorsFile::Open(dir + "/cut.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'w'"));
}

TEST(SafetensorsTest, CorruptHeaderIsRejected) {
  const std::string dir = ScratchDir("st_corrupt");
  WriteRaw(dir + "/json.safetensors", R"({"w":{"dtype":"F32",)", 0);
  EXPECT_THAT(SafetensorsFile::Open(dir + "/json.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "corrupt header"));
  // A header length larger than the file.
  std::string bytes(8, '\0');
  uint64_t huge = 1 << 20;
  std::memcpy(bytes.data(), &huge, 8);
  WriteStringToFile(dir + "/len.safetensors", bytes + "{}").IgnoreError();
  EXPECT_THAT(SafetensorsFile::Open(dir + "/len.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "header length"));
  WriteRaw(dir + "/overlap.safetensors",
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12);
  EXPECT_THAT(SafetensorsFile::Open(dir + "/overlap.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "overlapping"));
}

TEST(SafetensorsTest, UnknownDtypeNamesTheTensor) {
  const std::string dir = ScratchDir("st_dtype");
  WriteRaw(dir + "/d.safetensors",
           R"({"model.embed":{"dtype":"F8_E9M9","shape":[2],"data_offsets":[0,2]}})", 2);
  EXPECT_THAT(SafetensorsFile::Open(dir + "/d.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'model.embed': unknown dtype"));
}

TEST(SafetensorsTest, ShapeMismatchNamesTheTensor) {
  const std::string dir = ScratchDir("st_shape");
  WriteRaw(dir + "/s.safetensors",
           R"({"lm_head.weight":{"dtype":"F32","shape":[3,3],"data_offsets":[0,32]}})", 32);
  EXPECT_THAT(SafetensorsFile::Open(dir + "/s.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'lm_head.weight': shape mismatch"));
}

TEST(SafetensorsTest, DuplicateNamesAreRefusedOnWrite) {
  const std::string dir = ScratchDir("st_dup");
  float v = 1;
  EXPECT_THAT(WriteSafetensors(dir + "/d.safetensors",
                               {{"x", DType::kF32, {1}, &v}, {"x", DType::kF32, {1}, &v}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "duplicate tensor 'x'"));
}

}  // namespace
}  // namespace lorastep
