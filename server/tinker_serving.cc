#include "server/tinker_serving.h"

#include <fstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "lib/log.h"
#include "rpc/server_runner.h"

ABSL_FLAG(int, tinker_port, -1,
          "serve the Tinker SDK's HTTP protocol on this port (0: any free port; -1: off), on --host with the Trainer "
          "API's TLS certificate and API keys (the SDK sends its key as X-API-Key)");
ABSL_FLAG(std::string, tinker_port_file, "", "write the Tinker port here once it is served");
ABSL_FLAG(std::string, tinker_model_name, "",
          "the base model's name in the Tinker protocol (create_model's base_model, get_server_capabilities); "
          "default: the served model's folder");
ABSL_FLAG(double, tinker_lora_alpha, 32, "LoRA alpha of models made through the Tinker front (it sends only a rank)");
ABSL_FLAG(int64_t, tinker_session_ttl_s, 300,
          "a Tinker session without a heartbeat for this long expires and its models are deleted (0: never)");
ABSL_FLAG(int64_t, tinker_max_request_mb, 64, "the largest Tinker request body read, decoded");
ABSL_FLAG(int64_t, tinker_max_early_per_model, 1024,
          "calls of one Tinker model that may wait for a missing seq_id; more are refused");
ABSL_FLAG(int64_t, tinker_max_futures_per_key, 4096,
          "unfinished Tinker calls one API key may hold (finished ones are forgotten first to make room)");
ABSL_FLAG(int64_t, tinker_gap_wait_ms, 10000,
          "how long a Tinker model's early calls wait for a missing seq_id before it goes on without it");

namespace lorastep {
namespace {

// The model's positions from its config.json (0 when it cannot be read here: a remote worker's folder).
int64_t MaxContextLength(const std::string& model_path) {
  std::ifstream in(model_path + "/config.json");
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) return 0;
  if (auto it = config.find("text_config"); it != config.end() && it->is_object()) config = *it;
  auto it = config.find("max_position_embeddings");
  return it != config.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
}

}  // namespace

absl::StatusOr<TinkerServing> StartTinkerFromFlags(Coordinator* core, const ApiKeys* api_keys, Admission* admission,
                                                   const std::string& host, const std::string& tls_cert_file,
                                                   const std::string& tls_key_file, const std::string& state_dir,
                                                   const CallObservers& observers) {
  TinkerServing serving;
  const int port = absl::GetFlag(FLAGS_tinker_port);
  if (port < 0) return serving;
  if (port > 65535) return absl::InvalidArgumentError(absl::StrCat("tinker_port: '", port, "' is not a port"));
  TinkerFrontOptions options;
  options.model_name = absl::GetFlag(FLAGS_tinker_model_name).empty() ? core->model_path()
                                                                       : absl::GetFlag(FLAGS_tinker_model_name);
  options.max_context_length = MaxContextLength(core->model_path());
  options.lora_alpha = absl::GetFlag(FLAGS_tinker_lora_alpha);
  if (!(options.lora_alpha > 0)) return absl::InvalidArgumentError("tinker_lora_alpha: must be > 0");
  if (absl::GetFlag(FLAGS_tinker_session_ttl_s) < 0) {
    return absl::InvalidArgumentError("tinker_session_ttl_s: must be >= 0");
  }
  options.session_ttl = std::chrono::seconds(absl::GetFlag(FLAGS_tinker_session_ttl_s));
  if (absl::GetFlag(FLAGS_tinker_gap_wait_ms) < 0) return absl::InvalidArgumentError("tinker_gap_wait_ms: must be >= 0");
  options.gap_wait = std::chrono::milliseconds(absl::GetFlag(FLAGS_tinker_gap_wait_ms));
  for (const auto& [value, name, into] :
       {std::tuple{absl::GetFlag(FLAGS_tinker_max_early_per_model), "tinker_max_early_per_model",
                   &options.max_early_per_model},
        std::tuple{absl::GetFlag(FLAGS_tinker_max_futures_per_key), "tinker_max_futures_per_key",
                   &options.futures.max_per_owner}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrCat(name, ": must be >= 1"));
    *into = static_cast<size_t>(value);
  }
  HttpFrontOptions http;
  http.host = host;
  http.observers = observers;
  options.metrics = observers.metrics;
  http.port = port;
  const int64_t mb = absl::GetFlag(FLAGS_tinker_max_request_mb);
  if (mb < 1 || mb > 4096) return absl::InvalidArgumentError("tinker_max_request_mb: must be in [1, 4096]");
  http.max_body_bytes = mb << 20;
  if (!tls_cert_file.empty()) {
    auto cert = ReadPemFile(tls_cert_file, "tls_cert_file", PemKind::kCertificate);
    if (!cert.ok()) return cert.status();
    auto key = ReadPemFile(tls_key_file, "tls_key_file", PemKind::kPrivateKey);
    if (!key.ok()) return key.status();
    http.tls_cert_pem = *cert;
    http.tls_key_pem = *key;
  }
  if (!state_dir.empty()) {
    auto store = StateStore::Open(state_dir);
    if (!store.ok()) return store.status();
    serving.store = std::make_unique<StateStore>(std::move(store).value());
    options.store = serving.store.get();
  }
  serving.front = std::make_unique<TinkerFront>(core, api_keys, admission, options);
  auto server = HttpFrontServer::Start(serving.front.get(), http);
  if (!server.ok()) return server.status();
  serving.server = std::move(server).value();
  if (!absl::GetFlag(FLAGS_tinker_port_file).empty()) {
    if (absl::Status s = WritePortFile(absl::GetFlag(FLAGS_tinker_port_file), serving.server->port()); !s.ok()) {
      return s;
    }
  }
  LORASTEP_LOG(Info) << "lorastep_coordinator: Tinker protocol on " << host << ":" << serving.server->port()
                     << (http.tls_cert_pem.empty() ? "" : " (TLS)") << ", base model '" << options.model_name << "'";
  return serving;
}

}  // namespace lorastep
