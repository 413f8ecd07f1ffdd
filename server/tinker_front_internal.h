// Helpers shared by the Tinker front's files (tinker_front*.cc); not an interface.
#ifndef LORASTEP_SERVER_TINKER_FRONT_INTERNAL_H_
#define LORASTEP_SERVER_TINKER_FRONT_INTERNAL_H_

#include <cstdint>
#include <map>
#include <string>

#include <google/protobuf/message.h>
#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "server/tinker_futures.h"

namespace lorastep::tinker_internal {

using Json = nlohmann::json;

absl::StatusOr<Json> ParseObject(const std::string& body);
absl::StatusOr<std::string> StringField(const Json& j, const char* key);
absl::StatusOr<int64_t> IntField(const Json& j, const char* key);
// "<session>:train:<n>" -> "<session>-train-<n>"; NOT_FOUND naming model_id otherwise.
absl::StatusOr<std::string> RunIdOfModel(const std::string& model_id);
std::string ModelIdOf(const std::string& session, int64_t model_seq_id);
// A future's failed shape: {"error", "category"}.
HttpAnswer Failed(const absl::Status& status);
HttpAnswer ProtobufAnswer(const google::protobuf::Message& m);
std::string RandomHex(int bytes);
// A listing's `limit` (default 20, in [1, 1000]) and `offset` (default 0, >= 0) from its query.
struct Page {
  int64_t limit = 20, offset = 0;
};
Page PageOf(const std::map<std::string, std::string>& query);

// A checkpoint path tinker://<model_id>/<weights|sampler_weights>/<name>.
struct TinkerPath {
  std::string model_id;
  bool sampler = false;  // sampler_weights
  std::string name;
};
absl::StatusOr<TinkerPath> ParseTinkerPath(const std::string& path, const char* field);
std::string TinkerPathString(const TinkerPath& p);
// The state store's name of a checkpoint: tinker-weights.<name> / tinker-sampler.<name>.
std::string StoreName(const TinkerPath& p);
// A checkpoint name as given to save_weights: 1-100 characters of [A-Za-z0-9._-], not
// starting with '.'; INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckName(const std::string& name, const char* field);

}  // namespace lorastep::tinker_internal

#endif  // LORASTEP_SERVER_TINKER_FRONT_INTERNAL_H_
