// Conversions between the API's protobuf messages and lib/ types. Torch-free, so the
// coordinator validates requests without LibTorch. Unknown names and out-of-range options
// are INVALID_ARGUMENT naming the field.
#ifndef LORASTEP_RPC_PROTO_CONVERT_H_
#define LORASTEP_RPC_PROTO_CONVERT_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lib/training/adamw_params.h"
#include "lib/training/batch.h"
#include "lib/training/loss_config.h"
#include "lib/model/lora_config.h"
#include "lib/training/metrics.h"
#include "lorastep/v1/trainer.pb.h"
#include "lorastep/v1/worker.pb.h"

namespace lorastep {

std::vector<Datum> DatumsFromProto(const google::protobuf::RepeatedPtrField<v1::Datum>& datums);
// A PackedDatums' fields as views of bytes held elsewhere: a parsed message's, or a request's
// bytes as they came (PackedDatumsWire).
struct PackedArrays {
  std::vector<int32_t> lengths;
  absl::string_view tokens, target_tokens, weights, logprobs, advantages, ref_logprobs, old_logprobs,
      last_target_tokens;
  bool empty() const;
};
PackedArrays ArraysOf(const v1::PackedDatums& packed);
// Where each datum's positions begin in a packed batch's arrays (offsets: one per datum and
// the total last), once CheckPackedArrays has refused what RequestDatums refuses.
struct PackedLayout {
  std::vector<int64_t> offsets;
  bool next_token_targets = false;  // last_target_tokens instead of target_tokens
};
absl::StatusOr<PackedLayout> CheckPackedArrays(const PackedArrays& packed);
// (*out)[i] for i in [begin, end) from checked arrays; `out` holds a datum per length. Disjoint
// ranges may be unpacked on different threads.
void UnpackDatums(const PackedArrays& packed, const PackedLayout& layout, size_t begin, size_t end,
                  std::vector<Datum>* out);
// The datums of a request in either form: `datums`, or `packed_datums` (checked: every array
// 4 bytes per position, optional ones empty or full). Both set is INVALID_ARGUMENT naming
// packed_datums.
absl::StatusOr<std::vector<Datum>> RequestDatums(const google::protobuf::RepeatedPtrField<v1::Datum>& datums,
                                                 const PackedArrays& packed);
absl::StatusOr<std::vector<Datum>> RequestDatums(const google::protobuf::RepeatedPtrField<v1::Datum>& datums,
                                                 const v1::PackedDatums& packed);
// datums[i] for i in `indices` into a worker request: packed (tokens narrowed to int32:
// validate them first) when every optional field is on all of them or on none, which the
// packed form needs; else as `datums`.
void SetRequestDatums(const std::vector<Datum>& datums, const std::vector<int>& indices,
                      google::protobuf::RepeatedPtrField<v1::Datum>* as_datums, v1::PackedDatums* packed);
// A client's datums packed into `packed` (its arrays' buffers reused); false (`packed` left
// empty) when the packed form cannot say the same (an optional field on some datums only, an
// array of another length than its tokens, a token id outside int32): send them as datums,
// and the server names the problem.
bool PackDatums(const std::vector<v1::Datum>& datums, v1::PackedDatums* packed);
// The tag and length that start length-delimited field `field_number` of `length` bytes.
std::string LengthDelimitedHead(int field_number, size_t length);
// `packed` in wire form as field `field_number` of an enclosing message, its arrays not
// copied: head() is the field's tag and length and the small fields, pieces() the rest in
// order (each array's tag and length, then the array's own bytes in `packed`). Appended to
// the enclosing message's bytes they parse as that field. `packed` must outlive it; it does
// not move (pieces point into it).
class PackedDatumsField {
 public:
  PackedDatumsField(int field_number, const v1::PackedDatums& packed);
  PackedDatumsField(const PackedDatumsField&) = delete;
  PackedDatumsField& operator=(const PackedDatumsField&) = delete;
  const std::string& head() const { return head_; }
  const std::vector<absl::string_view>& pieces() const { return pieces_; }

 private:
  std::string head_;
  std::vector<std::string> array_headers_;  // reserved up front: pieces_ point into them
  std::vector<absl::string_view> pieces_;
};
absl::StatusOr<LossConfig> LossConfigFromProto(const v1::LossConfig& proto);
// Unset fields take AdamWParams' defaults; the result is validated.
absl::StatusOr<AdamWParams> AdamWParamsFromProto(const v1::AdamWParams& proto);
// train_attn / train_mlp / train_unembed become target_modules (INVALID_ARGUMENT naming the
// field when they come with target_modules or train nothing).
absl::StatusOr<LoraConfig> LoraConfigFromProto(const v1::LoraConfig& proto);
void LoraConfigToProto(const LoraConfig& config, v1::LoraConfig* out);
void MetricsToProto(const Metrics& metrics, google::protobuf::Map<std::string, double>* out);
// Sums, counts and maxima, so metrics of several ranks merge exactly.
void MetricPartialsToProto(const Metrics& metrics,
                           google::protobuf::RepeatedPtrField<v1::MetricPartial>* out);
Metrics MetricsFromPartials(const google::protobuf::RepeatedPtrField<v1::MetricPartial>& partials);

}  // namespace lorastep

#endif  // LORASTEP_RPC_PROTO_CONVERT_H_
