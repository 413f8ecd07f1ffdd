#include "server/tinker_wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lorastep {
namespace {

template <typename T>
std::vector<T> LittleEndianArray(const std::string& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

template <typename T>
void AppendBytes(const T* values, size_t n, std::string* out) {
  out->append(reinterpret_cast<const char*>(values), n * sizeof(T));
}

const char* DTypeName(tinker_public::DType d) {
  switch (d) {
    case tinker_public::DTYPE_FLOAT32: return "float32";
    case tinker_public::DTYPE_INT64: return "int64";
    case tinker_public::DTYPE_INT32: return "int32";
    case tinker_public::DTYPE_BFLOAT16: return "bfloat16";
    default: return "unspecified";
  }
}

// One dense one-dimensional input of `tokens` values: its shape, encoding and byte length.
absl::Status CheckVector(const tinker_public::Tensor& t, const std::string& field, size_t tokens, size_t elem_bytes) {
  if (t.encoding_case() == tinker_public::Tensor::kSparseCsr) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": sparse tensors are not supported; send it dense"));
  }
  if (t.shape_size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape [", absl::StrJoin(t.shape(), ","),
                                                   "] is not supported (one value per token; top-K targets are not "
                                                   "built)"));
  }
  const size_t n = t.dense().size() / elem_bytes;
  if (t.dense().size() % elem_bytes != 0 || n != tokens || (t.shape_size() == 1 && t.shape(0) != int64_t(tokens))) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", t.shape_size() == 1 ? t.shape(0) : int64_t(n),
                                                   " values for ", tokens, " tokens (one per token)"));
  }
  return absl::OkStatus();
}

absl::Status FloatInput(const tinker_public::Tensor& t, const std::string& field, size_t tokens,
                        google::protobuf::RepeatedField<float>* out) {
  if (t.dtype() != tinker_public::DTYPE_FLOAT32) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", DTypeName(t.dtype()), ", expected float32"));
  }
  if (absl::Status s = CheckVector(t, field, tokens, sizeof(float)); !s.ok()) return s;
  for (float v : LittleEndianArray<float>(t.dense())) out->Add(v);
  return absl::OkStatus();
}

absl::Status TokenInput(const tinker_public::Tensor& t, const std::string& field, size_t tokens,
                        google::protobuf::RepeatedField<int64_t>* out) {
  if (t.dtype() == tinker_public::DTYPE_INT64) {
    if (absl::Status s = CheckVector(t, field, tokens, sizeof(int64_t)); !s.ok()) return s;
    for (int64_t v : LittleEndianArray<int64_t>(t.dense())) out->Add(v);
    return absl::OkStatus();
  }
  if (t.dtype() == tinker_public::DTYPE_INT32) {
    if (absl::Status s = CheckVector(t, field, tokens, sizeof(int32_t)); !s.ok()) return s;
    for (int32_t v : LittleEndianArray<int32_t>(t.dense())) out->Add(v);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", DTypeName(t.dtype()), ", expected int64"));
}

}  // namespace

absl::StatusOr<std::vector<v1::Datum>> DatumsFromTinker(const tinker_public::ForwardBackwardRequest& req) {
  const bool supervised = req.loss_fn() == "cross_entropy";
  std::vector<v1::Datum> datums;
  datums.reserve(req.data_size());
  for (int i = 0; i < req.data_size(); ++i) {
    const tinker_public::Datum& in = req.data(i);
    const std::string where = absl::StrCat("data[", i, "]");
    v1::Datum d;
    for (int c = 0; c < in.model_input_size(); ++c) {
      const tinker_public::Chunk& chunk = in.model_input(c);
      if (chunk.chunk_case() != tinker_public::Chunk::kEncodedText) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".model_input[", c, "]: only encoded_text chunks are "
                                                       "supported (this server's models take text only)"));
      }
      const std::string& bytes = chunk.encoded_text().tokens();
      if (bytes.size() % 4 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".model_input[", c, "].tokens: ", bytes.size(), " bytes, not int32 values"));
      }
      for (int32_t t : LittleEndianArray<int32_t>(bytes)) d.add_tokens(t);
    }
    const size_t n = d.tokens_size();
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat(where, ".model_input: no tokens"));
    for (const auto& [key, tensor] : in.loss_fn_inputs()) {
      const std::string field = absl::StrCat(where, ".loss_fn_inputs.", key);
      absl::Status s;
      if (key == "target_tokens") {
        s = TokenInput(tensor, field, n, d.mutable_target_tokens());
      } else if (key == "weights") {
        s = FloatInput(tensor, field, n, d.mutable_weights());
      } else if (key == "logprobs") {
        s = FloatInput(tensor, field, n, d.mutable_logprobs());
      } else if (key == "advantages") {
        s = FloatInput(tensor, field, n, d.mutable_advantages());
      } else {
        s = absl::InvalidArgumentError(
            absl::StrCat(field, ": unknown input (target_tokens, weights, logprobs, advantages are taken)"));
      }
      if (!s.ok()) return s;
    }
    std::vector<const char*> required = {"target_tokens"};
    if (!supervised) required.insert(required.end(), {"logprobs", "advantages"});
    for (const char* key : required) {
      if (!in.loss_fn_inputs().contains(key)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".loss_fn_inputs.", key, ": required by loss_fn '", req.loss_fn(), "'"));
      }
    }
    datums.push_back(std::move(d));
  }
  if (datums.empty()) return absl::InvalidArgumentError("data: no datums");
  return datums;
}

tinker_public::ForwardBackwardOutput TinkerForwardBackwardOutput(const v1::ForwardBackwardResponse& resp) {
  tinker_public::ForwardBackwardOutput out;
  out.set_loss_fn_output_type("TensorData");
  tinker_public::ArrayRecord* record = out.add_loss_fn_outputs();
  record->set_type_tag("TensorData");
  record->set_num_datums(resp.logprobs_size());
  tinker_public::BatchedTensor& logprobs = (*record->mutable_fields())["logprobs"];
  logprobs.set_dtype(tinker_public::DTYPE_FLOAT32);
  std::vector<int64_t> offsets = {0};
  for (const v1::TokenLogprobs& datum : resp.logprobs()) {
    AppendBytes(datum.values().data(), datum.values_size(), logprobs.mutable_data());
    offsets.push_back(static_cast<int64_t>(logprobs.data().size()));
  }
  AppendBytes(offsets.data(), offsets.size(), logprobs.mutable_offsets());
  for (const auto& [key, value] : resp.metrics()) {
    if (std::count(key.begin(), key.end(), ':') == 1) (*out.mutable_metrics())[key] = value;
  }
  return out;
}

absl::StatusOr<v1::AdamWParams> AdamWFromTinker(const nlohmann::json& adam_params) {
  if (!adam_params.is_object()) return absl::InvalidArgumentError("adam_params: expected an object");
  struct Key {
    const char* name;
    double fallback;
    void (v1::AdamWParams::*set)(double);
  };
  static const Key kKeys[] = {{"learning_rate", 1e-4, &v1::AdamWParams::set_lr},
                              {"beta1", 0.9, &v1::AdamWParams::set_beta1},
                              {"beta2", 0.95, &v1::AdamWParams::set_beta2},
                              {"eps", 1e-12, &v1::AdamWParams::set_eps},
                              {"weight_decay", 0.0, &v1::AdamWParams::set_weight_decay},
                              {"grad_clip_norm", 0.0, &v1::AdamWParams::set_max_grad_norm}};
  v1::AdamWParams out;
  for (const Key& key : kKeys) {
    double value = key.fallback;
    if (auto it = adam_params.find(key.name); it != adam_params.end() && !it->is_null()) {
      if (!it->is_number() || !std::isfinite(it->get<double>())) {
        return absl::InvalidArgumentError(absl::StrCat("adam_params.", key.name, ": expected a finite number"));
      }
      value = it->get<double>();
    }
    (out.*key.set)(value);
  }
  return out;
}

nlohmann::json TinkerMetrics(const google::protobuf::Map<std::string, double>& metrics) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [key, value] : std::map<std::string, double>(metrics.begin(), metrics.end())) {
    if (std::isfinite(value)) out[key] = value;
  }
  return out;
}

int HttpStatusOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kUnavailable: return 503;
    default: return 500;
  }
}

const char* FailureCategoryOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied: return "user";
    default: return "server";
  }
}

}  // namespace lorastep
