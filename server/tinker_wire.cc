#include "server/tinker_wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lorastep {
namespace {

constexpr int64_t kMaxTopK = 64;

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

// An input's values, row-major, with its columns (0: one value per token; K: K per token).
template <typename T>
struct Input {
  std::vector<T> values;
  int64_t cols = 0;
};

// A tensor of `tokens` rows as values of T (its dtype read as `Wire`): dense, or sparse CSR
// (the SDK's form for mostly-zero two-dimensional inputs).
template <typename T, typename Wire>
absl::StatusOr<Input<T>> Decode(const tinker_public::Tensor& t, const std::string& field, size_t tokens) {
  if (t.shape_size() > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape [", absl::StrJoin(t.shape(), ","), "]; one or two dimensions are taken"));
  }
  Input<T> in;
  in.cols = t.shape_size() == 2 ? t.shape(1) : 0;
  if (t.shape_size() >= 1 && t.shape(0) != int64_t(tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", t.shape(0), " rows for ", tokens, " tokens (one per token)"));
  }
  if (in.cols < 0 || in.cols > kMaxTopK || (t.shape_size() == 2 && in.cols == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", in.cols, " values per token; 1-", kMaxTopK, " are taken"));
  }
  const size_t width = in.cols == 0 ? 1 : size_t(in.cols), n = tokens * width;
  if (t.encoding_case() == tinker_public::Tensor::kSparseCsr) {
    if (in.cols == 0) return absl::InvalidArgumentError(absl::StrCat(field, ": a sparse tensor needs a shape [N, K]"));
    const auto& csr = t.sparse_csr();
    const std::vector<Wire> values = LittleEndianArray<Wire>(csr.values());
    const std::vector<int64_t> rows = LittleEndianArray<int64_t>(csr.crow_indices());
    const std::vector<int64_t> cols = LittleEndianArray<int64_t>(csr.col_indices());
    if (csr.values().size() % sizeof(Wire) != 0 || rows.size() != tokens + 1 || rows.front() != 0 ||
        rows.back() != int64_t(values.size()) || cols.size() != values.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": sparse_csr: crow_indices, col_indices and values do not describe ", tokens, " rows"));
    }
    in.values.assign(n, T(0));
    for (size_t r = 0; r < tokens; ++r) {
      if (rows[r + 1] < rows[r]) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": sparse_csr: crow_indices decrease"));
      }
      for (int64_t i = rows[r]; i < rows[r + 1]; ++i) {
        if (cols[i] < 0 || cols[i] >= in.cols) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ": sparse_csr: column ", cols[i], " outside [0, ", in.cols, ")"));
        }
        in.values[r * width + size_t(cols[i])] = static_cast<T>(values[size_t(i)]);
      }
    }
    return in;
  }
  if (t.dense().size() != n * sizeof(Wire)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", t.dense().size() / sizeof(Wire), " values for ",
                                                   tokens, " tokens",
                                                   in.cols ? absl::StrCat(" x ", in.cols) : std::string(),
                                                   " (one per token)"));
  }
  for (Wire v : LittleEndianArray<Wire>(t.dense())) in.values.push_back(static_cast<T>(v));
  return in;
}

absl::StatusOr<Input<float>> FloatInput(const tinker_public::Tensor& t, const std::string& field, size_t tokens) {
  if (t.dtype() != tinker_public::DTYPE_FLOAT32) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", DTypeName(t.dtype()), ", expected float32"));
  }
  return Decode<float, float>(t, field, tokens);
}

absl::StatusOr<Input<int64_t>> TokenInput(const tinker_public::Tensor& t, const std::string& field, size_t tokens) {
  if (t.dtype() == tinker_public::DTYPE_INT64) return Decode<int64_t, int64_t>(t, field, tokens);
  if (t.dtype() == tinker_public::DTYPE_INT32) return Decode<int64_t, int32_t>(t, field, tokens);
  return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", DTypeName(t.dtype()), ", expected int64"));
}

}  // namespace

absl::StatusOr<TinkerDatums> DatumsFromTinker(const tinker_public::ForwardBackwardRequest& req) {
  const bool supervised = req.loss_fn() == "cross_entropy";
  TinkerDatums out;
  int64_t request_k = -1;  // set by the first datum
  for (int i = 0; i < req.data_size(); ++i) {
    const tinker_public::Datum& in = req.data(i);
    const std::string where = absl::StrCat("data[", i, "]");
    std::vector<int64_t> tokens;
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
      for (int32_t t : LittleEndianArray<int32_t>(bytes)) tokens.push_back(t);
    }
    const size_t n = tokens.size();
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat(where, ".model_input: no tokens"));
    std::optional<Input<int64_t>> targets;
    std::map<std::string, Input<float>> floats;
    for (const auto& [key, tensor] : in.loss_fn_inputs()) {
      const std::string field = absl::StrCat(where, ".loss_fn_inputs.", key);
      if (key == "target_tokens") {
        auto decoded = TokenInput(tensor, field, n);
        if (!decoded.ok()) return decoded.status();
        targets = std::move(*decoded);
      } else if (key == "weights" || key == "logprobs" || key == "advantages") {
        auto decoded = FloatInput(tensor, field, n);
        if (!decoded.ok()) return decoded.status();
        floats[key] = std::move(*decoded);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": unknown input (target_tokens, weights, logprobs, advantages are taken)"));
      }
    }
    std::vector<std::string> required = {"target_tokens"};
    if (!supervised) required.insert(required.end(), {"logprobs", "advantages"});
    for (const std::string& key : required) {
      if (key == "target_tokens" ? !targets.has_value() : floats.count(key) == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".loss_fn_inputs.", key, ": required by loss_fn '", req.loss_fn(), "'"));
      }
    }
    // Top-K targets ([N, K]): cross_entropy only, its weights of the same shape, one K per
    // request (the result's log-probs share one trailing shape).
    const int64_t k = targets->cols;
    if (k > 0 && !supervised) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".loss_fn_inputs.target_tokens: top-K targets [N, K] are taken by cross_entropy only"));
    }
    for (const auto& [key, input] : floats) {
      if (input.cols != k) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".loss_fn_inputs.", key, ": ", input.cols,
                                                       " values per token, but target_tokens has ", k));
      }
    }
    if (request_k >= 0 && k != request_k) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".loss_fn_inputs.target_tokens: ", k,
                                                     " targets per token, data[0] has ", request_k,
                                                     "; a request's datums share one shape"));
    }
    request_k = k;
    // One lorastep datum per target column: with token losses summed, the K datums of one
    // column each add up to the top-K loss and its gradient.
    const int64_t columns = std::max<int64_t>(k, 1);
    for (int64_t col = 0; col < columns; ++col) {
      v1::Datum d;
      for (size_t p = 0; p < n; ++p) {
        d.add_tokens(tokens[p]);
        d.add_target_tokens(targets->values[p * columns + col]);
      }
      for (const auto& [key, input] : floats) {
        google::protobuf::RepeatedField<float>* field =
            key == "weights" ? d.mutable_weights() : key == "logprobs" ? d.mutable_logprobs() : d.mutable_advantages();
        for (size_t p = 0; p < n; ++p) field->Add(input.values[p * columns + col]);
      }
      out.datums.push_back(std::move(d));
    }
  }
  if (out.datums.empty()) return absl::InvalidArgumentError("data: no datums");
  out.top_k = std::max<int64_t>(request_k, 0);
  return out;
}

tinker_public::ForwardBackwardOutput TinkerForwardBackwardOutput(const v1::ForwardBackwardResponse& resp,
                                                                int64_t top_k) {
  tinker_public::ForwardBackwardOutput out;
  out.set_loss_fn_output_type("TensorData");
  tinker_public::ArrayRecord* record = out.add_loss_fn_outputs();
  record->set_type_tag("TensorData");
  const int64_t columns = std::max<int64_t>(top_k, 1);
  record->set_num_datums(resp.logprobs_size() / columns);
  tinker_public::BatchedTensor& logprobs = (*record->mutable_fields())["logprobs"];
  logprobs.set_dtype(tinker_public::DTYPE_FLOAT32);
  if (top_k > 0) logprobs.add_trailing_shape(top_k);
  std::vector<int64_t> offsets = {0};
  for (int64_t datum = 0; datum + columns <= resp.logprobs_size(); datum += columns) {
    // Position-major: [N, K], column k from the datum's k-th expansion.
    const int n = resp.logprobs(datum).values_size();
    std::vector<float> rows(size_t(n) * columns);
    for (int64_t col = 0; col < columns; ++col) {
      const auto& values = resp.logprobs(datum + col).values();
      for (int p = 0; p < n && p < values.size(); ++p) rows[size_t(p) * columns + col] = values[p];
    }
    AppendBytes(rows.data(), rows.size(), logprobs.mutable_data());
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

absl::Status StatusOfHttp(int http_status, const std::string& body) {
  if (http_status < 300) return absl::OkStatus();
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  const std::string message = j.is_object() && j.contains("detail") && j["detail"].is_string()
                                  ? j["detail"].get<std::string>()
                                  : absl::StrCat("HTTP ", http_status);
  switch (http_status) {
    case 400: return absl::InvalidArgumentError(message);
    case 401: return absl::UnauthenticatedError(message);
    case 403: return absl::PermissionDeniedError(message);
    case 404: return absl::NotFoundError(message);
    case 429: return absl::ResourceExhaustedError(message);
    case 503: return absl::UnavailableError(message);
    default: return absl::InternalError(message);
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
