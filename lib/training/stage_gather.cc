#include "lib/training/stage_gather.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"
#include "nlohmann/json.hpp"

namespace lorastep {

PackedTensors PackTensors(const std::vector<NamedTensor>& tensors) {
  PackedTensors packed;
  nlohmann::json header = nlohmann::json::array();
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor t = tensor.to(at::kCPU).contiguous();
    const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
    header.push_back({{"name", name},
                      {"dtype", static_cast<int>(t.scalar_type())},
                      {"shape", t.sizes().vec()},
                      {"offset", packed.bytes.size()},
                      {"nbytes", nbytes}});
    packed.bytes.append(static_cast<const char*>(t.data_ptr()), nbytes);
  }
  packed.header = header.dump();
  return packed;
}

absl::StatusOr<std::vector<NamedTensor>> UnpackTensors(const std::string& header_text, const char* bytes,
                                                       size_t size) {
  const nlohmann::json header = nlohmann::json::parse(header_text, nullptr, false);
  if (header.is_discarded() || !header.is_array()) return absl::DataLossError("stage gather: header is not a JSON array");
  std::vector<NamedTensor> out;
  for (const auto& e : header) {
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("dtype") ||
        !e["dtype"].is_number_integer() || !e.contains("shape") || !e["shape"].is_array() ||
        !e.contains("offset") || !e["offset"].is_number_unsigned() || !e.contains("nbytes") ||
        !e["nbytes"].is_number_unsigned()) {
      return absl::DataLossError("stage gather: a header entry lacks name, dtype, shape, offset or nbytes");
    }
    const std::string name = e["name"].get<std::string>();
    const int dtype = e["dtype"].get<int>();
    if (dtype < 0 || dtype >= static_cast<int>(at::ScalarType::NumOptions)) {
      return absl::DataLossError(absl::StrCat("stage gather: tensor '", name, "': unknown dtype ", dtype));
    }
    std::vector<int64_t> shape;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return absl::DataLossError(absl::StrCat("stage gather: tensor '", name, "': bad shape"));
      }
      shape.push_back(d.get<int64_t>());
    }
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)));
    const uint64_t offset = e["offset"].get<uint64_t>(), nbytes = e["nbytes"].get<uint64_t>();
    if (nbytes != static_cast<uint64_t>(t.numel()) * t.element_size() || offset > size || nbytes > size - offset) {
      return absl::DataLossError(absl::StrCat("stage gather: tensor '", name, "': its bytes do not match its shape "
                                              "or lie outside the ", size, " received"));
    }
    if (nbytes > 0) std::memcpy(t.data_ptr(), bytes + offset, nbytes);
    out.emplace_back(name, std::move(t));
  }
  return out;
}

absl::StatusOr<std::vector<NamedTensor>> GatherStagesToFirst(CommGroup& pipe, std::vector<NamedTensor> local,
                                                             const at::Device& device) {
  constexpr int kSizesTag = 2, kBytesTag = 3;
  if (pipe.rank() != 0) {
    const PackedTensors packed = PackTensors(local);
    at::Tensor sizes = at::tensor({static_cast<double>(packed.header.size()), static_cast<double>(packed.bytes.size())},
                                  at::kDouble);
    at::Tensor blob = at::empty({static_cast<int64_t>(packed.header.size() + packed.bytes.size())}, at::kByte);
    std::memcpy(blob.data_ptr(), packed.header.data(), packed.header.size());
    if (!packed.bytes.empty()) {
      std::memcpy(static_cast<char*>(blob.data_ptr()) + packed.header.size(), packed.bytes.data(), packed.bytes.size());
    }
    LORASTEP_RETURN_IF_ERROR(pipe.Send(sizes.to(device), 0, kSizesTag));
    LORASTEP_RETURN_IF_ERROR(pipe.Send(blob.to(device), 0, kBytesTag));
    return local;
  }
  std::vector<NamedTensor> all = std::move(local);
  for (int stage = 1; stage < pipe.size(); ++stage) {
    at::Tensor sizes = at::empty({2}, at::TensorOptions().dtype(at::kDouble).device(device));
    LORASTEP_RETURN_IF_ERROR(pipe.Recv(sizes, stage, kSizesTag));
    sizes = sizes.to(at::kCPU);
    const auto header_size = static_cast<int64_t>(sizes[0].item<double>());
    const auto bytes_size = static_cast<int64_t>(sizes[1].item<double>());
    at::Tensor blob = at::empty({header_size + bytes_size}, at::TensorOptions().dtype(at::kByte).device(device));
    LORASTEP_RETURN_IF_ERROR(pipe.Recv(blob, stage, kBytesTag));
    blob = blob.to(at::kCPU);
    const char* data = static_cast<const char*>(blob.data_ptr());
    LORASTEP_ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors,
                              UnpackTensors(std::string(data, header_size), data + header_size, bytes_size));
    for (auto& [name, t] : tensors) all.emplace_back(std::move(name), t.to(device));
  }
  return all;
}

}  // namespace lorastep
