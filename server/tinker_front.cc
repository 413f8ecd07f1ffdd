#include "server/tinker_front.h"

#include <algorithm>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "lib/run_tenant.h"
#include "lib/status_macros.h"
#include "rpc/bearer_token.h"
#include "server/run_names.h"
#include "server/tinker_front_internal.h"
#include "server/tinker_losses.h"
#include "server/tinker_wire.h"
#include "tinker/tinker_public.pb.h"

namespace lorastep {
namespace tinker_internal {

absl::StatusOr<Json> ParseObject(const std::string& body) {
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("body: expected a JSON object");
  return j;
}

absl::StatusOr<std::string> StringField(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return absl::InvalidArgumentError(absl::StrCat(key, ": expected a string"));
  return it->get<std::string>();
}

absl::StatusOr<int64_t> IntField(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": expected an integer"));
  }
  return it->get<int64_t>();
}

Page PageOf(const std::map<std::string, std::string>& query) {
  Page p;
  if (auto it = query.find("limit"); it != query.end()) (void)absl::SimpleAtoi(it->second, &p.limit);
  if (auto it = query.find("offset"); it != query.end()) (void)absl::SimpleAtoi(it->second, &p.offset);
  p.limit = std::max<int64_t>(1, std::min<int64_t>(p.limit, 1000));
  p.offset = std::max<int64_t>(0, p.offset);
  return p;
}

absl::StatusOr<std::string> RunIdOfModel(const std::string& model_id) {
  std::vector<std::string> parts = absl::StrSplit(model_id, ':');
  int64_t n;
  if (parts.size() != 3 || parts[1] != "train" || parts[0].empty() || !absl::SimpleAtoi(parts[2], &n) || n < 0 ||
      !ValidateStoreName(parts[0], "model_id").ok()) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", model_id, "'"));
  }
  return absl::StrCat(parts[0], "-train-", n);
}

std::string ModelIdOf(const std::string& session, int64_t model_seq_id) {
  return absl::StrCat(session, ":train:", model_seq_id);
}

HttpAnswer Failed(const absl::Status& status) {
  return JsonAnswer(Json{{"error", std::string(status.message())}, {"category", FailureCategoryOf(status)}}.dump());
}

HttpAnswer ProtobufAnswer(const google::protobuf::Message& m) {
  HttpAnswer a;
  a.content_type = "application/x-protobuf";
  a.body = m.SerializeAsString();
  return a;
}

std::string RandomHex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; i += 4) out += absl::StrFormat("%08x", rd());
  return out.substr(0, 2 * bytes);
}

absl::Status CheckName(const std::string& name, const char* field) {
  if (name.empty() || name.size() > 100 || name.front() == '.' || absl::StrContains(name, ".tmp-") ||
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") !=
          std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", name, "' must be 1-100 characters of [A-Za-z0-9._-], not starting with '.'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TinkerPath> ParseTinkerPath(const std::string& path, const char* field) {
  absl::string_view rest = path;
  std::vector<std::string> parts;
  if (absl::ConsumePrefix(&rest, "tinker://")) parts = absl::StrSplit(rest, '/');
  if (parts.size() != 3 || (parts[1] != "weights" && parts[1] != "sampler_weights")) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": '", path, "' is not tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>"));
  }
  TinkerPath p{parts[0], parts[1] == "sampler_weights", parts[2]};
  if (auto run = RunIdOfModel(p.model_id); !run.ok()) {
    return absl::NotFoundError(absl::StrCat(field, ": no checkpoint '", path, "'"));
  }
  LORASTEP_RETURN_IF_ERROR(CheckName(p.name, field));
  return p;
}

std::string TinkerPathString(const TinkerPath& p) {
  return absl::StrCat("tinker://", p.model_id, p.sampler ? "/sampler_weights/" : "/weights/", p.name);
}

std::string StoreName(const TinkerPath& p) {
  return absl::StrCat(p.sampler ? "tinker-sampler." : "tinker-weights.", p.name);
}

}  // namespace tinker_internal

namespace {

using namespace tinker_internal;

}  // namespace

TinkerFront::TinkerFront(Coordinator* core, const ApiKeys* api_keys, Admission* admission, TinkerFrontOptions options)
    : core_(core),
      api_keys_(api_keys),
      admission_(admission),
      options_(std::move(options)),
      futures_(options_.futures),
      sampling_executor_(options_.sampling_executors),
      executor_(options_.executors, std::chrono::microseconds(0), TenantOfRun) {
  if (options_.metrics != nullptr) {
    options_.metrics->Declare("lorastep_tinker_sessions", PrometheusRegistry::Type::kGauge,
                              "live sessions of the Tinker front");
    options_.metrics->Declare("lorastep_tinker_held_polls", PrometheusRegistry::Type::kGauge,
                              "retrieve_future long-polls held open by the Tinker front");
  }
  housekeeper_ = std::thread([this] { Housekeep(); });
}

TinkerFront::~TinkerFront() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  housekeeper_.join();
}

absl::StatusOr<Caller> TinkerFront::Authenticate(const std::string& route, const std::string& api_key) const {
  if (absl::StartsWith(route, "archive_download/")) return Caller{"", /*admin=*/false};  // the token decides
  if (api_keys_ == nullptr) return Caller{"", /*admin=*/true};
  if (api_key.empty()) return absl::UnauthenticatedError("X-API-Key: missing");
  return api_keys_->Authenticate("Bearer " + api_key);
}

absl::StatusOr<AdmissionTicket> TinkerFront::Admit(const Caller& caller, int64_t bytes) {
  if (admission_ == nullptr) return AdmissionTicket();
  return admission_->Admit(caller.owner, bytes);
}

void TinkerFront::Handle(const Caller& caller, TinkerRequest req, AdmissionTicket ticket, HttpReply reply) {
  if (req.method == "GET") {
    if (req.route == "healthz") return reply(JsonAnswer(R"({"status":"ok"})"));
    if (req.route == "get_server_capabilities") {
      return reply(JsonAnswer(Json{{"supported_models", Json::array({Json{{"model_name", options_.model_name},
                                                                          {"max_context_length",
                                                                           options_.max_context_length}}})}}
                                  .dump()));
    }
    if (absl::StartsWith(req.route, "training_runs") || absl::StartsWith(req.route, "checkpoints")) {
      return reply(TrainingRuns(caller, req));
    }
    if (absl::StartsWith(req.route, "samplers/")) return reply(GetSampler(caller, req.route.substr(9)));
    if (req.route == "sessions" || absl::StartsWith(req.route, "sessions/")) return reply(Sessions(caller, req));
    if (absl::StartsWith(req.route, "archive_download/")) return reply(ArchiveDownload(req));
  } else if (req.method == "POST") {
    return Post(caller, req, std::move(ticket), std::move(reply));
  } else if (req.method == "DELETE" && absl::StartsWith(req.route, "training_runs/")) {
    return reply(DeleteCheckpoint(caller, req));
  }
  reply(JsonAnswer(Json{{"detail", absl::StrCat("not served: ", req.method, " /api/v1/", req.route)}}.dump(), 404));
}

void TinkerFront::Post(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply) {
  const std::string& r = req.route;
  if (r == "client/config") {
    // The stock HTTP client, plain bodies, chunks of one forward_backward sent concurrently.
    return reply(JsonAnswer(Json{{"use_pyqwest_transport", false},
                                 {"pjwt_auth_enabled", false},
                                 {"parallel_fwdbwd_chunks", true},
                                 {"proto_compress_fwdbwd", false}}
                                .dump()));
  }
  if (r == "client/dynamic_config") return reply(JsonAnswer(R"({"refresh_interval_sec":300})"));
  if (r == "telemetry") return reply(JsonAnswer(R"({"status":"accepted"})"));  // dropped
  if (r == "create_session") return reply(CreateSession(caller, req));
  if (r == "session_heartbeat") return reply(Heartbeat(caller, req.body));
  if (r == "get_info") return reply(GetInfo(caller, req.body));
  if (r == "create_model") return CreateModel(caller, req, std::move(ticket), std::move(reply));
  if (r == "forward_backward") return ForwardBackward(caller, req, std::move(ticket), std::move(reply));
  if (r == "optim_step") return OptimStep(caller, req, std::move(ticket), std::move(reply));
  if (r == "unload_model") return UnloadModel(caller, req, std::move(reply));
  if (r == "save_weights") return SaveWeights(caller, req, /*for_sampler=*/false, std::move(ticket), std::move(reply));
  if (r == "save_weights_for_sampler") {
    return SaveWeights(caller, req, /*for_sampler=*/true, std::move(ticket), std::move(reply));
  }
  if (r == "load_weights") return LoadWeights(caller, req, std::move(ticket), std::move(reply));
  if (r == "weights_info") return reply(WeightsInfo(caller, req.body));
  if (r == "create_sampling_session") return CreateSamplingSession(caller, req.body, std::move(reply));
  if (r == "asample") return ASample(caller, req, std::move(ticket), std::move(reply));
  if (r == "retrieve_future") {
    auto body = ParseObject(req.body);
    if (!body.ok()) return reply(ErrorAnswer(body.status()));
    auto id = StringField(*body, "request_id");
    if (!id.ok()) return reply(ErrorAnswer(id.status()));
    return futures_.Retrieve(caller.owner, *id, std::move(reply));
  }
  reply(JsonAnswer(Json{{"detail", absl::StrCat("not served: POST /api/v1/", r)}}.dump(), 404));
}

HttpAnswer TinkerFront::CreateSession(const Caller& caller, const TinkerRequest& req) {
  if (auto parsed = ParseObject(req.body); !parsed.ok()) return ErrorAnswer(parsed.status());
  const std::string digest = Sha256Hex(req.body);
  std::lock_guard<std::mutex> lock(mu_);
  if (!req.idempotency_key.empty()) {  // a live session of this key's made by the same call
    for (const auto& [sid, s] : sessions_) {
      if (s.owner != caller.owner || s.idempotency_key != req.idempotency_key) continue;
      if (s.body_digest != digest) {
        return ErrorAnswer(absl::InvalidArgumentError(
            "X-Idempotency-Key: already used by a create_session with another body"));
      }
      return JsonAnswer(Json{{"session_id", sid}}.dump());
    }
  }
  const std::string id = "t" + RandomHex(8);
  size_t& live = sessions_of_owner_[caller.owner];
  if (live >= options_.max_sessions_per_owner) {
    return ErrorAnswer(absl::ResourceExhaustedError(absl::StrCat(
        "create_session: this key holds ", live, " live sessions, the most one key may; they expire ",
        options_.session_ttl.count() / 1000, " s after their last heartbeat")));
  }
  ++live;
  Session& s = sessions_[id];
  s.owner = caller.owner;
  s.last_seen = std::chrono::steady_clock::now();
  s.idempotency_key = req.idempotency_key;
  s.body_digest = digest;
  return JsonAnswer(Json{{"session_id", id}}.dump());
}

HttpAnswer TinkerFront::Sessions(const Caller& caller, const TinkerRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (req.route == "sessions") {
    const Page page = PageOf(req.query);
    Json ids = Json::array();
    int64_t index = 0;
    for (const auto& [id, s] : sessions_) {
      if (s.owner != caller.owner) continue;
      if (index >= page.offset && index < page.offset + page.limit) ids.push_back(id);
      ++index;
    }
    return JsonAnswer(Json{{"sessions", ids}}.dump());
  }
  const std::string id = req.route.substr(9);  // after "sessions/"
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.owner != caller.owner) {
    return ErrorAnswer(absl::NotFoundError(absl::StrCat("session_id: no session '", id, "' (expired?)")));
  }
  Json models = Json::array(), samplers = Json::array();
  for (const auto& [seq, future] : it->second.create_requests) models.push_back(ModelIdOf(id, seq));
  for (const std::string& sampler : it->second.samplers) samplers.push_back(sampler);
  return JsonAnswer(Json{{"training_run_ids", models}, {"sampler_ids", samplers}}.dump());
}

HttpAnswer TinkerFront::Heartbeat(const Caller& caller, const std::string& body) {
  auto parsed = ParseObject(body);
  if (!parsed.ok()) return ErrorAnswer(parsed.status());
  auto id = StringField(*parsed, "session_id");
  if (!id.ok()) return ErrorAnswer(id.status());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(*id);
  if (it == sessions_.end() || it->second.owner != caller.owner) {
    return ErrorAnswer(absl::NotFoundError(absl::StrCat("session_id: no session '", *id, "' (expired?)")));
  }
  it->second.last_seen = std::chrono::steady_clock::now();
  return JsonAnswer("{}");
}

void TinkerFront::CreateModel(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket,
                              HttpReply reply) {
  auto body = ParseObject(req.body);
  if (!body.ok()) return reply(ErrorAnswer(body.status()));
  auto session = StringField(*body, "session_id");
  if (!session.ok()) return reply(ErrorAnswer(session.status()));
  auto model_seq = IntField(*body, "model_seq_id");
  if (!model_seq.ok()) return reply(ErrorAnswer(model_seq.status()));
  if (*model_seq < 0) return reply(ErrorAnswer(absl::InvalidArgumentError("model_seq_id: must be >= 0")));
  if (auto it = body->find("base_model"); it != body->end() && !it->is_null() &&
                                          (!it->is_string() || it->get<std::string>() != options_.model_name)) {
    return reply(ErrorAnswer(absl::InvalidArgumentError(
        absl::StrCat("base_model: ", it->dump(), " is not served here; this server serves '", options_.model_name,
                     "'"))));
  }
  v1::CreateRunRequest create;
  const Json lora = body->value("lora_config", Json::object());
  if (!lora.is_object()) return reply(ErrorAnswer(absl::InvalidArgumentError("lora_config: expected an object")));
  const Json rank = lora.value("rank", Json(32));
  if (!rank.is_number_integer() || rank.get<int64_t>() < 1) {
    return reply(ErrorAnswer(absl::InvalidArgumentError("lora_config.rank: expected an integer >= 1")));
  }
  create.mutable_lora()->set_rank(rank.get<int64_t>());
  create.mutable_lora()->set_alpha(options_.lora_alpha);
  using Setter = void (v1::LoraConfig::*)(bool);
  for (const auto& [key, set] : {std::pair<const char*, Setter>{"train_attn", &v1::LoraConfig::set_train_attn},
                                 {"train_mlp", &v1::LoraConfig::set_train_mlp},
                                 {"train_unembed", &v1::LoraConfig::set_train_unembed}}) {
    const Json v = lora.value(key, Json(true));
    if (!v.is_boolean()) {
      return reply(ErrorAnswer(absl::InvalidArgumentError(absl::StrCat("lora_config.", key, ": expected a boolean"))));
    }
    (create.mutable_lora()->*set)(v.get<bool>());
  }
  if (const Json seed = lora.value("seed", Json()); !seed.is_null()) {
    if (!seed.is_number_integer()) {
      return reply(ErrorAnswer(absl::InvalidArgumentError("lora_config.seed: expected an integer")));
    }
    create.set_seed(seed.get<uint64_t>());
  } else {
    std::random_device rd;
    create.set_seed((uint64_t{rd()} << 32) | rd());
  }
  const std::string model_id = ModelIdOf(*session, *model_seq);
  const std::string client_run = *RunIdOfModel(model_id);
  create.set_run_id(client_run);
  create.set_request_id(absl::StrCat("tinker-create-", client_run));
  std::string future;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(*session);
    if (it == sessions_.end() || it->second.owner != caller.owner) {
      return reply(ErrorAnswer(absl::NotFoundError(absl::StrCat("session_id: no session '", *session, "'"))));
    }
    it->second.last_seen = std::chrono::steady_clock::now();
    if (auto done = it->second.create_requests.find(*model_seq); done != it->second.create_requests.end()) {
      return reply(JsonAnswer(Json{{"request_id", done->second}, {"model_id", model_id}}.dump()));  // a replay
    }
    auto id = futures_.Create(caller.owner);
    if (!id.ok()) return reply(ErrorAnswer(id.status()));
    future = *id;
    it->second.create_requests[*model_seq] = future;
  }
  const std::string run = ServerRunId(caller, client_run);
  executor_.Submit(run, [this, caller, create, run, model_id, future, ticket = std::make_shared<AdmissionTicket>(
                                                                               std::move(ticket))] {
    auto created = core_->CreateRun(create, caller.owner, OwnerRunPrefix(caller.owner));
    if (!created.ok()) return futures_.Finish(future, Failed(ClientStatus(caller, created.status())));
    {
      std::lock_guard<std::mutex> lock(mu_);
      models_[run].known = true;  // seq_id 1 comes next
    }
    futures_.Finish(future, JsonAnswer(Json{{"model_id", model_id}}.dump()));
  });
  reply(JsonAnswer(Json{{"request_id", future}, {"model_id", model_id}}.dump()));
}

absl::StatusOr<std::string> TinkerFront::ModelRun(const Caller& caller, const std::string& model_id) {
  auto client_run = RunIdOfModel(model_id);
  if (!client_run.ok()) return client_run.status();
  const std::string run = ServerRunId(caller, *client_run);
  if (!Reaches(run, caller)) return absl::NotFoundError(absl::StrCat("model_id: no model '", model_id, "'"));
  return run;
}

absl::StatusOr<TinkerFront::ModelCall> TinkerFront::ParseModelCall(const Caller& caller, const std::string& body) {
  ModelCall call;
  LORASTEP_ASSIGN_OR_RETURN(call.body, ParseObject(body));
  LORASTEP_ASSIGN_OR_RETURN(call.model_id, StringField(call.body, "model_id"));
  LORASTEP_ASSIGN_OR_RETURN(call.seq, IntField(call.body, "seq_id"));
  LORASTEP_ASSIGN_OR_RETURN(call.run, ModelRun(caller, call.model_id));
  return call;
}

bool TinkerFront::Reaches(const std::string& run, const Caller& caller) {
  return core_->CheckAccess(run, caller).ok() && core_->GetRun(run).ok();
}

HttpAnswer TinkerFront::GetInfo(const Caller& caller, const std::string& body) {
  auto parsed = ParseObject(body);
  if (!parsed.ok()) return ErrorAnswer(parsed.status());
  auto model_id = StringField(*parsed, "model_id");
  if (!model_id.ok()) return ErrorAnswer(model_id.status());
  auto run = ModelRun(caller, *model_id);
  if (!run.ok()) return ErrorAnswer(run.status());
  Json info = {{"model_id", *model_id},
               {"model_data", {{"model_name", options_.model_name}, {"tokenizer_id", options_.model_name}}},
               {"is_lora", true}};
  return JsonAnswer(info.dump());
}

void TinkerFront::Sequenced(const Caller& caller, const std::string& run, int64_t seq_id,
                            const std::string& body_digest, AdmissionTicket ticket, std::function<HttpAnswer()> work,
                            HttpReply reply) {
  if (seq_id < 1) return reply(ErrorAnswer(absl::InvalidArgumentError("seq_id: must be >= 1")));
  std::unique_lock<std::mutex> lock(mu_);
  ModelQueue& q = models_[run];
  if (!q.known) {  // a model made before this process started: it goes on from this call
    q.known = true;
    q.next_seq = seq_id;
  }
  if (auto it = q.submitted.find(seq_id); it != q.submitted.end()) {
    if (it->second.body_digest != body_digest) {
      return reply(ErrorAnswer(absl::InvalidArgumentError(
          absl::StrCat("seq_id: ", seq_id, " was already used by this model with another body"))));
    }
    return reply(JsonAnswer(Json{{"request_id", it->second.request_id}}.dump()));  // a replay
  }
  if (seq_id < q.next_seq) {
    return reply(ErrorAnswer(absl::InvalidArgumentError(absl::StrCat(
        "seq_id: ", seq_id, " came after this model's later calls ran (next is ", q.next_seq, ")"))));
  }
  if (q.early.size() >= options_.max_early_per_model) {
    return reply(ErrorAnswer(absl::InvalidArgumentError(absl::StrCat(
        "seq_id: ", options_.max_early_per_model, " calls of this model wait for seq_id ", q.next_seq,
        " already (--tinker_max_early_per_model)"))));
  }
  auto future = futures_.Create(caller.owner);
  if (!future.ok()) return reply(ErrorAnswer(future.status()));
  q.submitted[seq_id] = Submitted{body_digest, *future};
  while (q.submitted.size() > 4096) q.submitted.erase(q.submitted.begin());
  auto held = std::make_shared<AdmissionTicket>(std::move(ticket));
  q.early[seq_id] = Early{std::chrono::steady_clock::now(), [this, id = *future, work = std::move(work), held] {
                            futures_.Finish(id, work());
                            held->Release();
                          }};
  Release(run, q);
  lock.unlock();
  reply(JsonAnswer(Json{{"request_id", *future}}.dump()));
}

void TinkerFront::Release(const std::string& run, ModelQueue& q) {
  while (!q.early.empty() && q.early.begin()->first == q.next_seq) {
    executor_.Submit(run, std::move(q.early.begin()->second.run));
    q.early.erase(q.early.begin());
    ++q.next_seq;
  }
}

void TinkerFront::ForwardBackward(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket,
                                  HttpReply reply) {
  auto fb = std::make_shared<tinker_public::ForwardBackwardRequest>();
  if (!fb->ParseFromString(req.body)) {
    return reply(ErrorAnswer(absl::InvalidArgumentError("body: not a tinker_public.ForwardBackwardRequest")));
  }
  auto run = ModelRun(caller, fb->model_id());
  if (!run.ok()) return reply(ErrorAnswer(run.status()));
  std::map<std::string, double> config(fb->loss_fn_config().begin(), fb->loss_fn_config().end());
  auto loss = LossConfigFromTinker(fb->loss_fn(), config);
  if (!loss.ok()) return reply(ErrorAnswer(loss.status()));
  auto datums = DatumsFromTinker(*fb);
  if (!datums.ok()) return reply(ErrorAnswer(datums.status()));
  const int64_t top_k = datums->top_k;
  auto shared = std::make_shared<std::vector<v1::Datum>>(std::move(datums->datums));
  const int64_t seq = fb->seq_id();
  const bool forward_only = fb->forward_only();
  auto work = [this, caller, run = *run, seq, forward_only, top_k, loss = *loss, shared]() -> HttpAnswer {
    absl::StatusOr<v1::ForwardBackwardResponse> out;
    if (forward_only) {
      v1::ForwardRequest f;
      f.set_run_id(run);
      for (v1::Datum& d : *shared) *f.add_datums() = std::move(d);
      out = core_->Forward(f);
    } else {
      v1::ForwardBackwardRequest fb;
      if (absl::Status s = Stamp(run, seq, &fb); !s.ok()) return Failed(ClientStatus(caller, s));
      *fb.mutable_loss() = loss;
      for (v1::Datum& d : *shared) *fb.add_datums() = std::move(d);
      out = core_->ForwardBackward(fb);
    }
    if (!out.ok()) return Failed(ClientStatus(caller, out.status()));
    return ProtobufAnswer(TinkerForwardBackwardOutput(*out, top_k));
  };
  Sequenced(caller, *run, seq, Sha256Hex(req.body), std::move(ticket), std::move(work), std::move(reply));
}

void TinkerFront::OptimStep(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket,
                            HttpReply reply) {
  auto call = ParseModelCall(caller, req.body);
  if (!call.ok()) return reply(ErrorAnswer(call.status()));
  auto adam = AdamWFromTinker(call->body.value("adam_params", Json::object()));
  if (!adam.ok()) return reply(ErrorAnswer(adam.status()));
  auto work = [this, caller, run = call->run, seq = call->seq, adam = *adam]() -> HttpAnswer {
    v1::OptimStepRequest step;
    if (absl::Status s = Stamp(run, seq, &step); !s.ok()) return Failed(ClientStatus(caller, s));
    *step.mutable_adamw() = adam;
    auto out = core_->OptimStep(step);
    if (!out.ok()) return Failed(ClientStatus(caller, out.status()));
    return JsonAnswer(Json{{"metrics", TinkerMetrics(out->metrics())}}.dump());
  };
  Sequenced(caller, call->run, call->seq, Sha256Hex(req.body), std::move(ticket), std::move(work), std::move(reply));
}

void TinkerFront::UnloadModel(const Caller& caller, const TinkerRequest& req, HttpReply reply) {
  auto body = ParseObject(req.body);
  if (!body.ok()) return reply(ErrorAnswer(body.status()));
  auto model_id = StringField(*body, "model_id");
  if (!model_id.ok()) return reply(ErrorAnswer(model_id.status()));
  auto run = ModelRun(caller, *model_id);
  if (!run.ok()) return reply(ErrorAnswer(run.status()));
  auto future = futures_.Create(caller.owner);
  if (!future.ok()) return reply(ErrorAnswer(future.status()));
  executor_.Submit(*run, [this, caller, run = *run, model_id = *model_id, id = *future] {
    absl::Status deleted = core_->DeleteRun(run);
    if (deleted.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      models_.erase(run);
    }
    futures_.Finish(id, deleted.ok() ? JsonAnswer(Json{{"model_id", model_id}}.dump())
                                     : Failed(ClientStatus(caller, deleted)));
  });
  reply(JsonAnswer(Json{{"request_id", *future}}.dump()));
}

void TinkerFront::Housekeep() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(100));
    const auto now = std::chrono::steady_clock::now();
    if (options_.metrics != nullptr) {
      options_.metrics->Set("lorastep_tinker_sessions", {}, static_cast<double>(sessions_.size()));
      options_.metrics->Set("lorastep_tinker_held_polls", {}, static_cast<double>(futures_.held_polls()));
    }
    // A model whose next seq_id has not come within gap_wait of its successor goes on.
    for (auto& [run, q] : models_) {
      if (!q.early.empty() && now - q.early.begin()->second.arrived >= options_.gap_wait) {
        q.next_seq = q.early.begin()->first;
        Release(run, q);
      }
    }
    for (auto it = archive_links_.begin(); it != archive_links_.end();) {
      it = it->second.until <= now ? archive_links_.erase(it) : std::next(it);
    }
    if (options_.session_ttl.count() == 0) continue;
    std::vector<std::string> expired_runs;
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (now - it->second.last_seen < options_.session_ttl) {
        ++it;
        continue;
      }
      if (!it->second.base_run.empty()) expired_runs.push_back(it->second.base_run);
      if (--sessions_of_owner_[it->second.owner] == 0) sessions_of_owner_.erase(it->second.owner);
      for (auto sampler = samplers_.begin(); sampler != samplers_.end();) {
        sampler = sampler->second.session == it->first ? samplers_.erase(sampler) : std::next(sampler);
      }
      const std::string prefix = absl::StrCat(OwnerRunPrefix(it->second.owner), it->first, "-train-");
      for (auto m = models_.lower_bound(prefix); m != models_.end() && absl::StartsWith(m->first, prefix);) {
        expired_runs.push_back(m->first);
        m = models_.erase(m);
      }
      it = sessions_.erase(it);
    }
    for (const std::string& run : expired_runs) {
      executor_.Submit(run, [this, run] { (void)core_->DeleteRun(run); });
    }
  }
}

}  // namespace lorastep
