// The Tinker front's sampling: sampling sessions, asample (compute_logprobs is an asample
// with prompt_logprobs), and samplers/{id}. Samples come from the coordinator's Sample on the
// same model code the trainer runs.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "lib/sampling/sampling_bounds.h"
#include "lib/status_macros.h"
#include "server/run_names.h"
#include "server/tinker_front.h"
#include "server/tinker_front_internal.h"
#include "server/tinker_wire.h"
#include "tinker/tinker_public.pb.h"

namespace lorastep {
namespace {

using namespace tinker_internal;

template <typename T>
void AppendBytes(T value, std::string* out) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// The sampling parameters of an asample body as lorastep's.
absl::Status ParamsFromTinker(const Json& params, int64_t prompt_tokens, int64_t max_context, v1::SamplingParams* out) {
  if (!params.is_object()) return absl::InvalidArgumentError("sampling_params: expected an object");
  auto number = [&](const char* key, double fallback, double* value) -> absl::Status {
    auto it = params.find(key);
    if (it == params.end() || it->is_null()) {
      *value = fallback;
      return absl::OkStatus();
    }
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
      return absl::InvalidArgumentError(absl::StrCat("sampling_params.", key, ": expected a finite number"));
    }
    *value = it->get<double>();
    return absl::OkStatus();
  };
  double max_tokens, temperature, top_k, top_p;
  const double room = max_context > prompt_tokens ? double(max_context - prompt_tokens) : 1.0;
  LORASTEP_RETURN_IF_ERROR(number("max_tokens", room, &max_tokens));
  LORASTEP_RETURN_IF_ERROR(number("temperature", 1.0, &temperature));
  LORASTEP_RETURN_IF_ERROR(number("top_k", -1, &top_k));
  LORASTEP_RETURN_IF_ERROR(number("top_p", 1.0, &top_p));
  if (max_tokens < 1 || max_tokens != std::floor(max_tokens)) {
    return absl::InvalidArgumentError("sampling_params.max_tokens: expected an integer >= 1");
  }
  if (top_k != std::floor(top_k) || (top_k < 1 && top_k != -1 && top_k != 0)) {
    return absl::InvalidArgumentError("sampling_params.top_k: expected -1 (off) or an integer >= 1");
  }
  out->set_max_tokens(static_cast<int64_t>(max_tokens));
  out->set_temperature(temperature);
  out->set_top_k(top_k > 0 ? static_cast<int64_t>(top_k) : 0);
  out->set_top_p(top_p);
  if (auto seed = params.find("seed"); seed != params.end() && !seed->is_null()) {
    if (!seed->is_number_integer() || (!seed->is_number_unsigned() && seed->get<int64_t>() < 0)) {
      return absl::InvalidArgumentError("sampling_params.seed: expected an integer >= 0");
    }
    out->set_seed(seed->get<uint64_t>());  // read as an integer: seeds past 2^53 stay exact
  } else {
    out->set_seed((uint64_t{std::random_device{}()} << 32) | std::random_device{}());
  }
  if (auto stop = params.find("stop"); stop != params.end() && !stop->is_null()) {
    const bool tokens = stop->is_array() && std::all_of(stop->begin(), stop->end(),
                                                        [](const Json& v) { return v.is_number_integer(); });
    if (!tokens) {
      return absl::InvalidArgumentError(
          "sampling_params.stop: stop strings are not supported (the server holds no tokenizer); send stop token ids");
    }
    for (const Json& t : *stop) out->add_stop_token_ids(t.get<int64_t>());
  }
  return absl::OkStatus();
}

// The SDK's answer; `topk` > 0: each prompt position's k most likely tokens as one N x k
// matrix (N prompt tokens; the first position and positions with fewer than k are padded
// with token 0 at -99999, which the SDK reads as empty).
tinker_public::SampleResponse TinkerSampleResponse(const v1::PromptSamples& prompt, bool with_prompt_logprobs,
                                                   int64_t topk) {
  tinker_public::SampleResponse out;
  for (const v1::SampledSequence& seq : prompt.sequences()) {
    tinker_public::SampledSequence* s = out.add_sequences();
    s->set_stop_reason(seq.stop_reason() == "length" ? tinker_public::STOP_REASON_LENGTH
                                                     : tinker_public::STOP_REASON_STOP);
    for (int64_t t : seq.tokens()) AppendBytes(static_cast<int32_t>(t), s->mutable_tokens());
    std::string logprobs;
    for (float lp : seq.sampling_logprobs()) AppendBytes(lp, &logprobs);
    s->set_logprobs(logprobs);
  }
  if (with_prompt_logprobs) {
    std::string lp;
    AppendBytes(std::numeric_limits<float>::quiet_NaN(), &lp);  // the first token has none
    for (float v : prompt.prompt_logprobs()) AppendBytes(v, &lp);
    out.set_prompt_logprobs(lp);
  }
  if (topk > 0) {
    const int64_t n = prompt.prompt_top_logprobs_size() + 1;
    tinker_public::TopkPromptLogprobs* top = out.mutable_topk_prompt_logprobs();
    top->set_k(static_cast<uint32_t>(topk));
    top->set_prompt_length(static_cast<uint32_t>(n));
    for (int64_t row = 0; row < n; ++row) {
      const v1::TopLogprobs* best = row > 0 ? &prompt.prompt_top_logprobs(static_cast<int>(row - 1)) : nullptr;
      for (int64_t j = 0; j < topk; ++j) {
        const bool have = best != nullptr && j < best->tokens_size();
        AppendBytes(static_cast<int32_t>(have ? best->tokens(static_cast<int>(j)) : 0), top->mutable_token_ids());
        AppendBytes(have ? best->logprobs(static_cast<int>(j)) : -99999.0f, top->mutable_logprobs());
      }
    }
  }
  return out;
}

}  // namespace

void TinkerFront::AddSampler(const std::string& id, const Caller& caller, const std::string& session,
                             const std::string& run, const std::string& checkpoint, const std::string& model_path) {
  if (auto owning = sessions_.find(session); owning != sessions_.end()) {
    std::deque<std::string>& kept = owning->second.samplers;
    kept.push_back(id);
    while (kept.size() > options_.samplers_per_session) {  // the oldest sampler is forgotten
      samplers_.erase(kept.front());
      kept.pop_front();
    }
  }
  Sampler& s = samplers_[id];
  s.owner = caller.owner;
  s.session = session;
  s.run = run;
  s.checkpoint = checkpoint;
  s.model_path = model_path;
}

void TinkerFront::CreateSamplingSession(const Caller& caller, const std::string& body, HttpReply reply) {
  auto parsed = ParseObject(body);
  if (!parsed.ok()) return reply(ErrorAnswer(parsed.status()));
  auto session = StringField(*parsed, "session_id");
  if (!session.ok()) return reply(ErrorAnswer(session.status()));
  auto seq = IntField(*parsed, "sampling_session_seq_id");
  if (!seq.ok()) return reply(ErrorAnswer(seq.status()));
  const std::string id = absl::StrCat(*session, ":sample:", *seq);
  std::string run, checkpoint, model_path;
  if (auto p = parsed->find("model_path"); p != parsed->end() && !p->is_null()) {
    if (!p->is_string()) return reply(ErrorAnswer(absl::InvalidArgumentError("model_path: expected a string")));
    model_path = p->get<std::string>();
    auto path = ParseTinkerPath(model_path, "model_path");
    if (!path.ok()) return reply(ErrorAnswer(path.status()));
    run = ServerRunId(caller, *RunIdOfModel(path->model_id));
    if (!Reaches(run, caller)) {
      return reply(ErrorAnswer(absl::NotFoundError(absl::StrCat(
          "model_path: the model of '", model_path,
          "' is gone (its session expired); load_weights it into a model and save_weights_for_sampler again"))));
    }
    checkpoint = StateRef(run, StoreName(*path));
  } else if (auto b = parsed->find("base_model"); b != parsed->end() && b->is_string()) {
    if (b->get<std::string>() != options_.model_name) {
      return reply(ErrorAnswer(absl::InvalidArgumentError(absl::StrCat(
          "base_model: '", b->get<std::string>(), "' is not served here; this server serves '", options_.model_name,
          "'"))));
    }
  } else {
    return reply(ErrorAnswer(absl::InvalidArgumentError("base_model or model_path: one is required")));
  }
  std::unique_lock<std::mutex> lock(mu_);
  auto s = sessions_.find(*session);
  if (s == sessions_.end() || s->second.owner != caller.owner) {
    return reply(ErrorAnswer(absl::NotFoundError(absl::StrCat("session_id: no session '", *session, "'"))));
  }
  s->second.last_seen = std::chrono::steady_clock::now();
  if (auto known = samplers_.find(id); known != samplers_.end()) {  // a replay
    return reply(JsonAnswer(Json{{"sampling_session_id", id}}.dump()));
  }
  if (!run.empty()) {
    AddSampler(id, caller, *session, run, checkpoint, model_path);
    return reply(JsonAnswer(Json{{"sampling_session_id", id}}.dump()));
  }
  // The base model samples through a run of the session's own (made once).
  const std::string client_base = absl::StrCat(*session, "-base");
  const std::string base = ServerRunId(caller, client_base);
  const bool exists = !s->second.base_run.empty();
  s->second.base_run = base;
  lock.unlock();
  executor_.Submit(base, [this, caller, id, session = *session, base, client_base, exists, reply] {
    if (!exists) {
      v1::CreateRunRequest create;
      create.set_run_id(client_base);
      create.set_request_id(absl::StrCat("tinker-create-", client_base));
      create.mutable_lora()->set_rank(1);
      create.mutable_lora()->set_alpha(1);
      auto created = core_->CreateRun(create, caller.owner, OwnerRunPrefix(caller.owner));
      if (!created.ok() && !absl::IsAlreadyExists(created.status())) {
        return reply(ErrorAnswer(ClientStatus(caller, created.status())));
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      AddSampler(id, caller, session, base, "", "");
    }
    reply(JsonAnswer(Json{{"sampling_session_id", id}}.dump()));
  });
}

void TinkerFront::ASample(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply) {
  auto body = ParseObject(req.body);
  if (!body.ok()) return reply(ErrorAnswer(body.status()));
  auto sampler_id = StringField(*body, "sampling_session_id");
  if (!sampler_id.ok()) return reply(ErrorAnswer(sampler_id.status()));
  auto seq = IntField(*body, "seq_id");
  if (!seq.ok()) return reply(ErrorAnswer(seq.status()));
  v1::SampleRequest sample;
  const Json num = body->value("num_samples", Json(1));
  if (!num.is_number_integer() || num.get<int64_t>() < 1) {
    return reply(ErrorAnswer(absl::InvalidArgumentError("num_samples: expected an integer >= 1")));
  }
  sample.set_num_samples(num.get<int64_t>());
  v1::TokenSequence* prompt = sample.add_prompts();
  const Json chunks = body->value("prompt", Json::object()).value("chunks", Json());
  if (!chunks.is_array()) return reply(ErrorAnswer(absl::InvalidArgumentError("prompt.chunks: expected an array")));
  for (size_t c = 0; c < chunks.size(); ++c) {
    const Json& chunk = chunks[c];
    if (!chunk.is_object() || chunk.value("type", std::string("encoded_text")) != "encoded_text" ||
        !chunk.value("tokens", Json()).is_array()) {
      return reply(ErrorAnswer(absl::InvalidArgumentError(absl::StrCat(
          "prompt.chunks[", c, "]: only encoded_text chunks are supported (this server's models take text only)"))));
    }
    for (const Json& t : chunk["tokens"]) {
      if (!t.is_number_integer()) {
        return reply(ErrorAnswer(absl::InvalidArgumentError(absl::StrCat("prompt.chunks[", c, "].tokens: integers"))));
      }
      prompt->add_tokens(t.get<int64_t>());
    }
  }
  if (prompt->tokens_size() == 0) return reply(ErrorAnswer(absl::InvalidArgumentError("prompt: no tokens")));
  const Json topk_field = body->value("topk_prompt_logprobs", Json(0));
  if (!topk_field.is_number_integer() || topk_field.get<int64_t>() < 0 ||
      topk_field.get<int64_t>() > kMaxTopLogprobs) {
    return reply(ErrorAnswer(absl::InvalidArgumentError(
        absl::StrCat("topk_prompt_logprobs: expected an integer in [0, ", kMaxTopLogprobs, "]"))));
  }
  const int64_t topk = topk_field.get<int64_t>();
  const bool prompt_logprobs = body->value("prompt_logprobs", false);
  if (absl::Status s = ParamsFromTinker(body->value("sampling_params", Json::object()), prompt->tokens_size(),
                                        options_.max_context_length, sample.mutable_params());
      !s.ok()) {
    return reply(ErrorAnswer(s));
  }
  sample.mutable_params()->set_prompt_logprobs(prompt_logprobs || topk > 0);
  sample.mutable_params()->set_prompt_top_logprobs(topk);
  std::string future;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = samplers_.find(*sampler_id);
    if (it == samplers_.end() || it->second.owner != caller.owner) {
      return reply(ErrorAnswer(absl::NotFoundError(absl::StrCat("sampling_session_id: no sampler '", *sampler_id, "'"))));
    }
    if (auto done = it->second.samples.find(*seq); done != it->second.samples.end()) {
      return reply(JsonAnswer(Json{{"request_id", done->second}}.dump()));  // a replay
    }
    auto id = futures_.Create(caller.owner);
    if (!id.ok()) return reply(ErrorAnswer(id.status()));
    future = *id;
    it->second.samples[*seq] = future;
    while (it->second.samples.size() > 4096) it->second.samples.erase(it->second.samples.begin());
    sample.set_run_id(it->second.run);
    sample.set_base_model(it->second.checkpoint.empty());
    sample.set_checkpoint(it->second.checkpoint);
  }
  sampling_executor_.Submit(future, [this, caller, future, sample, prompt_logprobs, topk,
                                     held = std::make_shared<AdmissionTicket>(std::move(ticket))] {
    auto out = core_->Sample(sample);
    futures_.Finish(future, out.ok() ? ProtobufAnswer(TinkerSampleResponse(out->prompts(0), prompt_logprobs, topk))
                                     : Failed(ClientStatus(caller, out.status())));
    held->Release();
  });
  reply(JsonAnswer(Json{{"request_id", future}}.dump()));
}

HttpAnswer TinkerFront::GetSampler(const Caller& caller, const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = samplers_.find(id);
  if (it == samplers_.end() || it->second.owner != caller.owner) {
    return ErrorAnswer(absl::NotFoundError(absl::StrCat("sampler_id: no sampler '", id, "'")));
  }
  Json out = {{"sampler_id", id}, {"base_model", options_.model_name}};
  if (!it->second.model_path.empty()) out["model_path"] = it->second.model_path;
  return JsonAnswer(out.dump());
}

}  // namespace lorastep
