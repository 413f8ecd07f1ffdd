// The Tinker front's checkpoints: save_weights (+ for_sampler), load_weights, weights_info,
// the REST listing and deletion of checkpoints, and archive downloads.
#include <ctime>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "lib/io/file_util.h"
#include "lib/io/tar_archive.h"
#include "lib/model/lora_config.h"
#include "rpc/bearer_token.h"
#include "server/run_names.h"
#include "server/tinker_front.h"
#include "server/tinker_front_internal.h"
#include "server/tinker_wire.h"

namespace lorastep {
namespace {

using namespace tinker_internal;

// The PEFT export beside a weights/ checkpoint, which its archive serves.
std::string PeftExportName(const std::string& name) { return absl::StrCat("tinker-weights-peft.", name); }
std::string EphemeralName(int64_t seq_id) { return absl::StrCat("tinker-ephemeral.", seq_id); }

std::string IsoTime(int64_t unix_s) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixSeconds(unix_s), absl::UTCTimeZone());
}

// A stored folder's name as a Tinker checkpoint: (sampler, name), or nothing for lorastep's own.
bool AsTinkerCheckpoint(const std::string& stored, bool* sampler, std::string* name) {
  absl::string_view rest = stored;
  if (absl::ConsumePrefix(&rest, "tinker-weights.")) {
    *sampler = false;
  } else if (absl::ConsumePrefix(&rest, "tinker-sampler.")) {
    *sampler = true;
  } else {
    return false;
  }
  *name = std::string(rest);
  return true;
}

}  // namespace

void TinkerFront::SaveWeights(const Caller& caller, const TinkerRequest& req, bool for_sampler, AdmissionTicket ticket,
                              HttpReply reply) {
  auto call = ParseModelCall(caller, req.body);
  if (!call.ok()) return reply(ErrorAnswer(call.status()));
  const Json& body = call->body;
  const std::string &model_id = call->model_id, &run = call->run;
  const int64_t seq = call->seq;
  if (auto ttl = body.find("ttl_seconds"); ttl != body.end() && !ttl->is_null()) {
    return reply(ErrorAnswer(absl::InvalidArgumentError(
        "ttl_seconds: not supported; checkpoints live until deleted or the server's --state_ttl_hours")));
  }
  TinkerPath path{model_id, for_sampler, ""};
  int64_t sampling_seq = -1;  // an unnamed sampler save: the sampling session it makes
  if (auto p = body.find("path"); p != body.end() && !p->is_null()) {
    if (!p->is_string()) return reply(ErrorAnswer(absl::InvalidArgumentError("path: expected a string")));
    path.name = p->get<std::string>();
    if (absl::Status s = CheckName(path.name, "path"); !s.ok()) return reply(ErrorAnswer(s));
  } else if (for_sampler) {
    auto n = IntField(body, "sampling_session_seq_id");
    if (!n.ok()) {
      return reply(ErrorAnswer(absl::InvalidArgumentError("path or sampling_session_seq_id: one is required")));
    }
    sampling_seq = *n;
  } else {
    return reply(ErrorAnswer(absl::InvalidArgumentError("path: required")));
  }
  const bool overwrite = body.value("overwrite", false);
  const std::string session = model_id.substr(0, model_id.find(':'));
  auto work = [this, caller, run, path, seq, sampling_seq, overwrite, session]() -> HttpAnswer {
    const std::string stored = sampling_seq >= 0 ? EphemeralName(seq) : StoreName(path);
    if (!overwrite && sampling_seq < 0) {
      v1::ListCheckpointsRequest list;
      list.set_run_id(run);
      auto listed = core_->ListCheckpoints(list);
      if (!listed.ok()) return Failed(ClientStatus(caller, listed.status()));
      for (const v1::Checkpoint& c : listed->checkpoints()) {
        if (c.name() == stored) {
          return Failed(absl::AlreadyExistsError(absl::StrCat("path: '", path.name,
                                                              "' is saved already for this model; choose another "
                                                              "name, or delete it first")));
        }
      }
    }
    v1::ExportAdapterRequest export_req;
    export_req.set_run_id(run);
    export_req.set_path(StateRef(run, path.sampler ? stored : PeftExportName(path.name)));
    if (!path.sampler) {
      v1::SaveStateRequest save;
      save.set_run_id(run);
      save.set_path(StateRef(run, stored));
      if (auto saved = core_->SaveState(save); !saved.ok()) return Failed(ClientStatus(caller, saved.status()));
    }
    if (auto exported = core_->ExportAdapter(export_req); !exported.ok()) {
      return Failed(ClientStatus(caller, exported.status()));
    }
    if (sampling_seq < 0) return JsonAnswer(Json{{"path", TinkerPathString(path)}}.dump());
    const std::string sampler = absl::StrCat(session, ":sample:", sampling_seq);
    std::string drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      AddSampler(sampler, caller, session, run, StateRef(run, stored), "");
      ModelQueue& q = models_[run];
      q.ephemeral.push_back(stored);
      if (q.ephemeral.size() > options_.ephemeral_samplers_kept) {
        drop = q.ephemeral.front();
        q.ephemeral.pop_front();
      }
    }
    if (!drop.empty()) {  // an older unnamed save: its sampling session now answers NOT_FOUND
      v1::DeleteCheckpointRequest del;
      del.set_run_id(run);
      del.set_name(drop);
      (void)core_->DeleteCheckpoint(del);
    }
    return JsonAnswer(Json{{"sampling_session_id", sampler}}.dump());
  };
  Sequenced(caller, run, seq, Sha256Hex(req.body), std::move(ticket), std::move(work), std::move(reply));
}

void TinkerFront::LoadWeights(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket,
                              HttpReply reply) {
  auto call = ParseModelCall(caller, req.body);
  if (!call.ok()) return reply(ErrorAnswer(call.status()));
  const Json& body = call->body;
  const std::string& run = call->run;
  const int64_t seq = call->seq;
  auto path_text = StringField(body, "path");
  if (!path_text.ok()) return reply(ErrorAnswer(path_text.status()));
  auto path = ParseTinkerPath(*path_text, "path");
  if (!path.ok()) return reply(ErrorAnswer(path.status()));
  if (path->sampler) {
    return reply(ErrorAnswer(absl::InvalidArgumentError(
        "path: a sampler_weights checkpoint holds no training state; load_weights takes a weights/ checkpoint")));
  }
  if (auto token = body.find("weights_access_token"); token != body.end() && !token->is_null()) {
    return reply(ErrorAnswer(absl::InvalidArgumentError("weights_access_token: not supported (no shared checkpoints)")));
  }
  const bool optimizer = body.value("optimizer", false);
  const std::string source = ServerRunId(caller, *RunIdOfModel(path->model_id));
  auto work = [this, caller, run, seq, optimizer, ref = StateRef(source, StoreName(*path))]() -> HttpAnswer {
    v1::LoadStateRequest load;
    if (absl::Status s = Stamp(run, seq, &load); !s.ok()) return Failed(ClientStatus(caller, s));
    load.set_path(ref);
    load.set_weights_only(!optimizer);
    if (auto loaded = core_->LoadState(load); !loaded.ok()) return Failed(ClientStatus(caller, loaded.status()));
    return JsonAnswer("{}");
  };
  Sequenced(caller, run, seq, Sha256Hex(req.body), std::move(ticket), std::move(work), std::move(reply));
}

HttpAnswer TinkerFront::WeightsInfo(const Caller& caller, const std::string& body) {
  auto parsed = ParseObject(body);
  if (!parsed.ok()) return ErrorAnswer(parsed.status());
  auto text = StringField(*parsed, "tinker_path");
  if (!text.ok()) return ErrorAnswer(text.status());
  auto path = ParseTinkerPath(*text, "tinker_path");
  if (!path.ok()) return ErrorAnswer(path.status());
  const std::string run = ServerRunId(caller, *RunIdOfModel(path->model_id));
  Json info = {{"base_model", options_.model_name}, {"is_lora", true}};
  // The switches as the targets say them: the SDK's create_training_client_from_state makes
  // the new model with these (true where absent), and a load into other targets fails.
  auto set_switches = [&info](const std::vector<std::string>& targets) {
    if (const std::optional<TinkerSwitches> s = SwitchesFromTargets(targets)) {
      info["train_attn"] = s->train_attn;
      info["train_mlp"] = s->train_mlp;
      info["train_unembed"] = s->train_unembed;
    }
  };
  if (auto state = core_->CheckAccess(run, caller).ok() ? core_->GetRun(run) : absl::NotFoundError(""); state.ok()) {
    info["lora_rank"] = state->lora().rank();
    set_switches({state->lora().target_modules().begin(), state->lora().target_modules().end()});
    return JsonAnswer(info.dump());
  }
  // The model is gone (its session expired): its checkpoint in the store says its rank.
  if (options_.store != nullptr) {
    if (auto folder = options_.store->Resolve(StateRef(run, StoreName(*path)), "tinker_path"); folder.ok()) {
      const std::string file = *folder + (path->sampler ? "/adapter_config.json" : "/trainer_state.json");
      if (auto text = ReadFileToString(file); text.ok()) {
        Json state = Json::parse(*text, nullptr, false);
        const Json lora = state.is_object() ? (path->sampler ? state : state.value("lora", Json::object())) : Json();
        const Json rank = lora.is_object() ? lora.value(path->sampler ? "r" : "rank", Json()) : Json();
        if (rank.is_number_integer()) {
          info["lora_rank"] = rank;
          std::vector<std::string> targets;
          for (const Json& t : lora.value("target_modules", Json::array())) {
            if (t.is_string()) targets.push_back(t.get<std::string>());
          }
          set_switches(targets);
          return JsonAnswer(info.dump());
        }
      }
    }
  }
  return ErrorAnswer(absl::NotFoundError(absl::StrCat("tinker_path: no checkpoint '", *text, "'")));
}

HttpAnswer TinkerFront::TrainingRuns(const Caller& caller, const TinkerRequest& req) {
  std::vector<std::string> parts = absl::StrSplit(req.route, '/');
  auto checkpoints_of = [&](const std::string& model_id) -> absl::StatusOr<Json> {
    auto client_run = RunIdOfModel(model_id);
    if (!client_run.ok()) return client_run.status();
    const std::string run = ServerRunId(caller, *client_run);
    std::vector<v1::Checkpoint> found;
    if (options_.store != nullptr) {
      auto listed = options_.store->List(run);
      if (!listed.ok()) return listed.status();
      for (const StoredFolder& f : *listed) {
        v1::Checkpoint c;
        c.set_name(f.name);
        c.set_bytes(f.bytes);
        c.set_modified_unix_s(f.modified_unix_s);
        found.push_back(c);
      }
    } else if (Reaches(run, caller)) {
      v1::ListCheckpointsRequest list;
      list.set_run_id(run);
      auto listed = core_->ListCheckpoints(list);
      if (!listed.ok()) return listed.status();
      found.assign(listed->checkpoints().begin(), listed->checkpoints().end());
    }
    Json out = Json::array();
    for (const v1::Checkpoint& c : found) {
      TinkerPath p{model_id, false, ""};
      if (!AsTinkerCheckpoint(c.name(), &p.sampler, &p.name)) continue;
      out.push_back({{"checkpoint_id", absl::StrCat(p.sampler ? "sampler_weights/" : "weights/", p.name)},
                     {"checkpoint_type", p.sampler ? "sampler" : "training"},
                     {"time", IsoTime(c.modified_unix_s())},
                     {"tinker_path", TinkerPathString(p)},
                     {"size_bytes", c.bytes()},
                     {"public", false}});
    }
    return out;
  };
  auto run_json = [&](const v1::Run& r, const std::string& model_id) {
    const int64_t last_ms = r.last_step_unix_ms() > 0 ? r.last_step_unix_ms() : r.created_unix_ms();
    return Json{{"training_run_id", model_id},
                {"base_model", options_.model_name},
                {"model_owner", caller.owner},
                {"is_lora", true},
                {"corrupted", false},
                {"lora_rank", r.lora().rank()},
                {"last_request_time", IsoTime(last_ms / 1000)},
                {"user_metadata", Json::object()}};
  };
  // The caller's models: runs named <session>-train-<n> in the caller's namespace.
  auto models = [&] {
    std::vector<std::pair<std::string, v1::Run>> out;
    for (const v1::Run& r : core_->ListRuns()) {
      if (!core_->CheckAccess(r.run_id(), caller).ok()) continue;  // listed: it exists
      const std::string id = ClientRunId(caller, r.run_id());
      const size_t at = id.rfind("-train-");
      if (at == std::string::npos || at == 0) continue;
      const std::string model_id = absl::StrCat(id.substr(0, at), ":train:", id.substr(at + 7));
      if (RunIdOfModel(model_id).value_or("") != id) continue;
      out.emplace_back(model_id, r);
    }
    return out;
  };
  auto page = [&](const Json& items, const char* key) {
    const Page p = PageOf(req.query);
    Json out = Json::array();
    for (int64_t i = p.offset; i < static_cast<int64_t>(items.size()) && i < p.offset + p.limit; ++i) {
      out.push_back(items[i]);
    }
    return Json{{key, out}, {"cursor", {{"offset", p.offset}, {"limit", p.limit}, {"total_count", items.size()}}}};
  };
  if (parts.size() == 1 && parts[0] == "training_runs") {
    Json all = Json::array();
    for (const auto& [id, r] : models()) all.push_back(run_json(r, id));
    return JsonAnswer(page(all, "training_runs").dump());
  }
  if (parts.size() == 1 && parts[0] == "checkpoints") {
    Json all = Json::array();
    for (const auto& [id, r] : models()) {
      auto listed = checkpoints_of(id);
      if (listed.ok()) {
        for (const Json& c : *listed) all.push_back(c);
      }
    }
    return JsonAnswer(page(all, "checkpoints").dump());
  }
  if (parts.size() >= 2 && parts[0] == "training_runs") {
    const std::string& model_id = parts[1];
    if (parts.size() == 2) {
      auto run = ModelRun(caller, model_id);
      if (!run.ok()) return ErrorAnswer(run.status());
      auto r = core_->GetRun(*run);
      if (!r.ok()) return ErrorAnswer(ClientStatus(caller, r.status()));
      return JsonAnswer(run_json(*r, model_id).dump());
    }
    if (parts.size() == 3 && parts[2] == "checkpoints") {
      auto listed = checkpoints_of(model_id);
      if (!listed.ok()) return ErrorAnswer(listed.status());
      if (listed->empty()) {  // no checkpoint and no model of this caller's by that id: unknown
        auto run = ModelRun(caller, model_id);
        if (!run.ok()) return ErrorAnswer(run.status());
      }
      return JsonAnswer(Json{{"checkpoints", *listed}}.dump());
    }
    if (parts.size() == 6 && parts[2] == "checkpoints" && parts[5] == "archive") {
      auto path = ParseTinkerPath(absl::StrCat("tinker://", model_id, "/", parts[3], "/", parts[4]), "checkpoint");
      if (!path.ok()) return ErrorAnswer(path.status());
      if (options_.store == nullptr) {
        return ErrorAnswer(absl::NotFoundError("archive: this coordinator does not share its workers' state store"));
      }
      const std::string run = ServerRunId(caller, *RunIdOfModel(model_id));
      auto folder = options_.store->Resolve(
          StateRef(run, path->sampler ? StoreName(*path) : PeftExportName(path->name)), "checkpoint");
      if (!folder.ok() || !PathExists(*folder + "/adapter_config.json")) {
        return ErrorAnswer(absl::NotFoundError(absl::StrCat("checkpoint: no checkpoint '", TinkerPathString(*path), "'")));
      }
      const std::string token = RandomHex(16);
      const auto until = std::chrono::steady_clock::now() + options_.archive_link_ttl;
      {
        std::lock_guard<std::mutex> lock(mu_);
        archive_links_[token] = ArchiveLink{*folder, until};
      }
      const int64_t expires = std::time(nullptr) + options_.archive_link_ttl.count() / 1000;
      return JsonAnswer(Json{{"url", absl::StrCat(req.base_url, "/api/v1/archive_download/", token)},
                             {"expires", IsoTime(expires)}}
                            .dump());
    }
  }
  return ErrorAnswer(absl::NotFoundError(absl::StrCat("not served: GET /api/v1/", req.route)));
}

HttpAnswer TinkerFront::DeleteCheckpoint(const Caller& caller, const TinkerRequest& req) {
  std::vector<std::string> parts = absl::StrSplit(req.route, '/');
  if (parts.size() != 5 || parts[2] != "checkpoints") {
    return ErrorAnswer(absl::NotFoundError(absl::StrCat("not served: DELETE /api/v1/", req.route)));
  }
  auto path = ParseTinkerPath(absl::StrCat("tinker://", parts[1], "/", parts[3], "/", parts[4]), "checkpoint");
  if (!path.ok()) return ErrorAnswer(path.status());
  const std::string run = ServerRunId(caller, *RunIdOfModel(path->model_id));
  std::vector<std::string> names = {StoreName(*path)};
  if (!path->sampler) names.push_back(PeftExportName(path->name));
  for (const std::string& name : names) {
    absl::Status s;
    if (Reaches(run, caller)) {
      v1::DeleteCheckpointRequest del;
      del.set_run_id(run);
      del.set_name(name);
      s = core_->DeleteCheckpoint(del);
    } else if (options_.store != nullptr) {
      s = options_.store->Delete(run, name);
    } else {
      s = absl::NotFoundError("");
    }
    if (absl::IsNotFound(s) && name == names[0]) {
      return ErrorAnswer(absl::NotFoundError(absl::StrCat("checkpoint: no checkpoint '", TinkerPathString(*path), "'")));
    }
    if (!s.ok() && !absl::IsNotFound(s)) return ErrorAnswer(ClientStatus(caller, s));
  }
  return JsonAnswer("{}");
}

HttpAnswer TinkerFront::ArchiveDownload(const TinkerRequest& req) {
  const std::string token = req.route.substr(std::string("archive_download/").size());
  std::string folder;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = archive_links_.find(token);
    if (it == archive_links_.end() || it->second.until <= std::chrono::steady_clock::now()) {
      return ErrorAnswer(absl::NotFoundError("archive: no such link, or it has expired"));
    }
    folder = it->second.folder;
  }
  HttpAnswer a;
  a.content_type = "application/x-tar";
  // The SDK's `tinker checkpoint download` wants the PEFT files and an empty checkpoint_complete.
  absl::Status s = WriteTarArchive(
      folder, "",
      [&a](absl::string_view bytes) {
        a.body.append(bytes.data(), bytes.size());
        return absl::OkStatus();
      },
      {{"checkpoint_complete", ""}});
  if (!s.ok()) return ErrorAnswer(s);
  return a;
}

}  // namespace lorastep
