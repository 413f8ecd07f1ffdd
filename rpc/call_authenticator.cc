#include "rpc/call_authenticator.h"

#include "absl/strings/match.h"

namespace lorastep {

absl::Status CallAuthenticator::Check(absl::string_view method_path, const std::string& authorization) const {
  for (const auto& [prefix, check] : rules_) {
    if (absl::StartsWith(method_path, prefix)) return check(authorization);
  }
  return absl::OkStatus();
}

namespace {

class MetadataProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit MetadataProcessor(std::shared_ptr<const CallAuthenticator> authenticator)
      : authenticator_(std::move(authenticator)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext*, OutputMetadata*, OutputMetadata*) override {
    auto value = [&](const char* key) {
      auto it = metadata.find(key);
      return it == metadata.end() ? std::string() : std::string(it->second.data(), it->second.size());
    };
    const absl::Status s = authenticator_->Check(value(":path"), value("authorization"));
    if (s.ok()) return grpc::Status::OK;
    return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
  }

 private:
  std::shared_ptr<const CallAuthenticator> authenticator_;
};

}  // namespace

std::shared_ptr<grpc::AuthMetadataProcessor> MetadataProcessorFor(std::shared_ptr<const CallAuthenticator> authenticator) {
  return std::make_shared<MetadataProcessor>(std::move(authenticator));
}

}  // namespace lorastep
