#include "server/local_mesh.h"

#include <dirent.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "lib/io/file_util.h"
#include "lib/model/model_config.h"
#include "lib/status_macros.h"

namespace lorastep {

int VisibleCudaDevices() {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    int n = 0;
    for (absl::string_view entry : absl::StrSplit(visible, ',', absl::SkipWhitespace())) {
      (void)entry;
      ++n;
    }
    return n;
  }
  int n = 0;
  if (DIR* dev = opendir("/dev")) {
    while (dirent* e = readdir(dev)) {
      int index = 0;
      if (std::strncmp(e->d_name, "nvidia", 6) == 0 && absl::SimpleAtoi(e->d_name + 6, &index)) ++n;
    }
    closedir(dev);
  }
  return n;
}

absl::Status CheckMeshSizes(const ParallelSizes& sizes) {
  constexpr int64_t kMax = 4096;
  int64_t world = 1;
  for (const auto& [size, flag] : {std::pair<int, const char*>{sizes.tp, "tp"},
                                   {sizes.pp, "pp"},
                                   {sizes.dp, "dp"},
                                   {sizes.ep, "ep"},
                                   {sizes.cp, "cp"}}) {
    if (size < 1 || size > kMax) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": ", size, " must be in [1, ", kMax, "]"));
    }
    if (std::strcmp(flag, "ep") != 0) world *= size;
    if (world > kMax) {
      return absl::InvalidArgumentError(absl::StrCat("tp/pp/dp/cp: a mesh of more than ", kMax, " ranks"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLocalMesh(const ParallelSizes& sizes, const std::string& model_dir, int device_slots,
                            const std::string& slots_what) {
  LORASTEP_RETURN_IF_ERROR(CheckMeshSizes(sizes));
  const int world = sizes.world();
  if (world > device_slots) {
    return absl::InvalidArgumentError(absl::StrCat("tp/pp/dp/cp: a mesh of ", sizes.tp, " x ", sizes.pp, " x ",
                                                   sizes.dp, " x ", sizes.cp, " = ", world,
                                                   " local workers is more than ", slots_what, " (",
                                                   device_slots, ")"));
  }
  LORASTEP_RETURN_IF_ERROR(ParallelLayout::Create(sizes, world).status());
  absl::StatusOr<std::string> json = ReadFileToString(model_dir + "/config.json");
  if (!json.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model: cannot read ", model_dir, "/config.json"));
  }
  LORASTEP_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfigJson(*json));
  return ValidateLayoutForModel(sizes, config);
}

}  // namespace lorastep
