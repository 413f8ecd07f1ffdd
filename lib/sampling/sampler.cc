#include "lib/sampling/sampler.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/model/qwen2.h"
#include "lib/torch_status.h"

namespace lorastep {

struct SamplerEngine::Sample {
  KvSequence kv;
  SampleStream stream{0};
  SampledSequence out;
  int64_t next_input = -1;  // the token fed at position kv.length in the next step
  bool done = false;
};

struct SamplerEngine::Request {
  int64_t id = 0;
  const Adapter* adapter = nullptr;
  SampleRequest request;
  int64_t worst_blocks = 0;
  int64_t worst_states = 0;
  KvSequence prompt;    // the prompt's blocks until its samples fork
  std::vector<Sample> samples;  // empty while the prompt is prefilled
  SampleResult result;
  std::chrono::steady_clock::time_point added, first_token;
};

SamplerEngine::SamplerEngine(const ModelConfig& config, const ModelWeights& weights, KvBlockPool* pool,
                             SamplerOptions options, const ModelShard* shard)
    : config_(config), weights_(weights), pool_(pool), options_(options), shard_(shard) {}

SamplerEngine::~SamplerEngine() {
  std::vector<int64_t> ids;
  for (const auto& r : running_) ids.push_back(r->id);
  for (int64_t id : ids) Cancel(id);
}

int64_t SamplerEngine::WorstCaseBlocks(const SampleRequest& r) const {
  const int64_t p = static_cast<int64_t>(r.prompt.size());
  const int64_t shared = p / pool_->shape().block_size;  // the prompt's full blocks
  return pool_->BlocksFor(p) + r.num_samples * (pool_->BlocksFor(p + r.params.max_tokens) - shared);
}

int64_t SamplerEngine::WorstCaseStates(const SampleRequest& r) const {
  if (options_.max_recurrent_sequences <= 0 || !config_.HasLinearAttention()) return 0;
  return r.num_samples == 1 ? 1 : r.num_samples + 1;
}

absl::StatusOr<int64_t> SamplerEngine::Add(const Adapter* adapter, SampleRequest request) {
  const int64_t vocab = config_.vocab_size;
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt: empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt[", i, "]: token ", request.prompt[i],
                                                     " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  if (request.num_samples < 1 || request.num_samples > kMaxSamplesPerPrompt) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_samples: ", request.num_samples, " is not in [1, ", kMaxSamplesPerPrompt, "]"));
  }
  if (absl::Status s = CheckSamplingParams(request.params, vocab, ""); !s.ok()) return s;
  const int64_t positions = static_cast<int64_t>(request.prompt.size()) + request.params.max_tokens;
  if (positions > config_.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: ", request.prompt.size(), " prompt tokens + ",
                                                   request.params.max_tokens, " is more than the model's ",
                                                   config_.max_position_embeddings, " positions"));
  }
  const int64_t worst = WorstCaseBlocks(request);
  if (worst > pool_->total_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: this request can need ", worst, " blocks of ", pool_->shape().block_size,
        " positions and the cache holds ", pool_->total_blocks(),
        " (fewer samples, a shorter prompt or max_tokens, or a larger --kv_cache_mb)"));
  }
  const int64_t states = WorstCaseStates(request);
  if (states > options_.max_recurrent_sequences) {  // 0 where no state is budgeted
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: this request's ", states, " sequences (its prompt and ", request.num_samples,
        " samples) each hold a linear-attention state and the cache's budget holds ",
        options_.max_recurrent_sequences, " (fewer samples, or a larger --kv_cache_mb)"));
  }
  if (static_cast<int64_t>(waiting_.size()) >= options_.max_waiting) {
    return absl::ResourceExhaustedError(
        absl::StrCat("max_waiting: ", options_.max_waiting, " sample requests already wait for the kv cache"));
  }
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->adapter = adapter;
  r->request = std::move(request);
  r->worst_blocks = worst;
  r->worst_states = states;
  r->added = std::chrono::steady_clock::now();
  waiting_.push_back(std::move(r));
  return waiting_.back()->id;
}

void SamplerEngine::Admit() {
  auto fits = [&](const Request& r) {
    return reserved_blocks_ + r.worst_blocks <= pool_->total_blocks() &&
           reserved_states_ + r.worst_states <= options_.max_recurrent_sequences;
  };
  while (!waiting_.empty() && fits(*waiting_.front())) {
    reserved_blocks_ += waiting_.front()->worst_blocks;
    reserved_states_ += waiting_.front()->worst_states;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

void SamplerEngine::Release(KvSequence& kv) {
  for (int32_t b : kv.blocks) pool_->Release(b);
  kv.blocks.clear();
  kv.recurrent.clear();
  kv.length = 0;
}

void SamplerEngine::Append(Request& r, Sample& s, int64_t token, float logprob, float sampling_logprob,
                           std::vector<TopLogprob> top) {
  const SamplingParams& p = r.request.params;
  SampledSequence& out = s.out;
  out.tokens.push_back(token);
  out.logprobs.push_back(logprob);
  out.sampling_logprobs.push_back(sampling_logprob);
  if (p.top_logprobs > 0) out.top_logprobs.push_back(std::move(top));
  bool stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
  for (const std::vector<int64_t>& seq : p.stop_sequences) {
    stop = stop || (out.tokens.size() >= seq.size() && std::equal(seq.rbegin(), seq.rend(), out.tokens.rbegin()));
  }
  if (stop || static_cast<int64_t>(out.tokens.size()) >= p.max_tokens) {
    out.stop_reason = stop ? "stop" : "length";
    s.done = true;
    Release(s.kv);
    return;
  }
  s.next_input = token;
}

namespace {

// The states of a step's sequences in the linear-attention layers, kept on each KvSequence.
struct SequenceRecurrence : RecurrentStates {
  std::vector<KvSequence*> sequences;  // in the packed row's order
  std::pair<at::Tensor, at::Tensor> Get(int64_t layer, size_t index) override {
    auto it = sequences[index]->recurrent.find(layer);
    return it == sequences[index]->recurrent.end() ? std::pair<at::Tensor, at::Tensor>() : it->second;
  }
  void Set(int64_t layer, size_t index, at::Tensor history, at::Tensor state) override {
    sequences[index]->recurrent[layer] = {std::move(history), std::move(state)};
  }
};

}  // namespace

absl::Status SamplerEngine::Fork(Request& r) {
  const int64_t p = r.prompt.length, bs = pool_->shape().block_size, shared = p / bs;
  r.first_token = std::chrono::steady_clock::now();
  r.result.time_to_first_token_s = std::chrono::duration<double>(r.first_token - r.added).count();
  r.samples.resize(r.request.num_samples);
  for (int64_t i = 0; i < r.request.num_samples; ++i) {
    r.samples[i].stream = SampleStream(r.request.params.seed + static_cast<uint64_t>(i));
  }
  if (r.request.num_samples == 1) {  // the one sample writes on in the prompt's own blocks
    r.samples[0].kv = std::move(r.prompt);
    r.prompt = KvSequence();
    return absl::OkStatus();
  }
  for (Sample& s : r.samples) {
    for (int64_t b = 0; b < shared; ++b) {
      pool_->Retain(r.prompt.blocks[b]);
      s.kv.blocks.push_back(r.prompt.blocks[b]);
    }
    for (const auto& [layer, state] : r.prompt.recurrent) {  // each sample's own copy of the prompt's
      s.kv.recurrent[layer] = {state.first.clone(), state.second.clone()};
    }
    if (p % bs != 0) {  // the prompt's partial block: each sample writes on after it
      absl::StatusOr<std::vector<int32_t>> own = pool_->Allocate(1);
      if (!own.ok()) return absl::InternalError(absl::StrCat("sampler: admitted request short of blocks: ", own.status().message()));
      pool_->CopyBlock(r.prompt.blocks[shared], own->front());
      s.kv.blocks.push_back(own->front());
    }
    s.kv.length = p;
  }
  Release(r.prompt);
  return absl::OkStatus();
}

void SamplerEngine::ApplyDraws(const at::Tensor& logits, const std::vector<Draw>& draws,
                               const std::vector<PromptLogprob>& prompt_lps) {
  if (draws.empty() && prompt_lps.empty()) return;
  const at::Device device = logits.device();
  const auto on_device = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(device); };
  const at::Tensor model = at::log_softmax(logits, -1);
  if (!prompt_lps.empty()) {
    std::vector<int64_t> rows, targets;
    for (const PromptLogprob& p : prompt_lps) rows.push_back(p.row), targets.push_back(p.target);
    const at::Tensor prompt_rows = model.index_select(0, on_device(rows));
    const at::Tensor lp = prompt_rows.gather(1, on_device(targets).unsqueeze(1)).squeeze(1).to(at::kCPU).contiguous();
    const float* v = lp.data_ptr<float>();
    for (size_t i = 0; i < prompt_lps.size(); ++i) prompt_lps[i].request->result.prompt_logprobs.push_back(v[i]);
    int64_t k = 0;
    for (const PromptLogprob& p : prompt_lps) k = std::max(k, p.request->request.params.prompt_top_logprobs);
    if (k > 0) {
      k = std::min<int64_t>(k, model.size(1));
      auto [values, ids] = prompt_rows.topk(k, -1);
      const at::Tensor host_values = values.to(at::kCPU).contiguous(), host_ids = ids.to(at::kCPU).contiguous();
      for (size_t i = 0; i < prompt_lps.size(); ++i) {
        SampleResult& result = prompt_lps[i].request->result;
        const int64_t mine = std::min(k, prompt_lps[i].request->request.params.prompt_top_logprobs);
        if (mine == 0) continue;
        std::vector<TopLogprob> best;
        for (int64_t j = 0; j < mine; ++j) {
          best.push_back({host_ids.data_ptr<int64_t>()[i * k + j], host_values.data_ptr<float>()[i * k + j]});
        }
        result.prompt_top_logprobs.push_back(std::move(best));
      }
    }
  }
  if (draws.empty()) return;
  // Each distinct row's sampling distribution once (a forked prompt's samples share one),
  // computed for all rows with the same parameters together.
  std::vector<int64_t> distinct;          // rows, in first-use order
  std::vector<int64_t> draw_distinct;     // per draw, its index in `distinct`
  for (const Draw& d : draws) {
    auto at = std::find(distinct.begin(), distinct.end(), d.row);
    draw_distinct.push_back(at - distinct.begin());
    if (at == distinct.end()) distinct.push_back(d.row);
  }
  std::vector<const SamplingParams*> distinct_params(distinct.size());
  for (size_t i = 0; i < draws.size(); ++i) distinct_params[draw_distinct[i]] = &draws[i].request->request.params;
  const auto same = [](const SamplingParams& a, const SamplingParams& b) {
    return a.temperature == b.temperature && a.top_k == b.top_k && a.top_p == b.top_p && a.min_p == b.min_p;
  };
  at::Tensor sampling = at::empty({static_cast<int64_t>(distinct.size()), logits.size(1)}, logits.options());
  std::vector<bool> done(distinct.size(), false);
  for (size_t i = 0; i < distinct.size(); ++i) {
    if (done[i]) continue;
    std::vector<int64_t> members, rows;
    for (size_t j = i; j < distinct.size(); ++j) {
      if (!done[j] && same(*distinct_params[j], *distinct_params[i])) {
        done[j] = true;
        members.push_back(static_cast<int64_t>(j));
        rows.push_back(distinct[j]);
      }
    }
    sampling.index_copy_(0, on_device(members), SamplingLogProbs(logits.index_select(0, on_device(rows)), *distinct_params[i]));
  }
  std::vector<int64_t> rows;
  std::vector<double> u;
  int64_t top = 0;
  for (const Draw& d : draws) {
    rows.push_back(d.row);
    u.push_back(d.sample->stream.Uniform());
    top = std::max(top, d.request->request.params.top_logprobs);
  }
  const at::Tensor drawn_sampling = sampling.index_select(0, on_device(draw_distinct));
  const at::Tensor drawn_model = model.index_select(0, on_device(rows));
  const at::Tensor tokens = DrawTokens(drawn_sampling, u);
  const at::Tensor picked = tokens.unsqueeze(1);
  // On the host, read in place (one element tensor per value would cost more than the draw).
  const at::Tensor host_tokens = tokens.to(at::kCPU).contiguous();
  const at::Tensor host_model = drawn_model.gather(1, picked).squeeze(1).to(at::kCPU).contiguous();
  const at::Tensor host_sampling = drawn_sampling.gather(1, picked).squeeze(1).to(at::kCPU).contiguous();
  at::Tensor top_values, top_ids;
  int64_t top_width = 0;
  if (top > 0) {
    top_width = std::min<int64_t>(top, drawn_model.size(1));
    auto [values, ids] = drawn_model.topk(top_width, -1);
    top_values = values.to(at::kCPU).contiguous();
    top_ids = ids.to(at::kCPU).contiguous();
  }
  const int64_t* token = host_tokens.data_ptr<int64_t>();
  const float* model_lp = host_model.data_ptr<float>();
  const float* sampling_lp = host_sampling.data_ptr<float>();
  for (size_t i = 0; i < draws.size(); ++i) {
    const Draw& d = draws[i];
    std::vector<TopLogprob> best;
    const int64_t k = std::min<int64_t>(d.request->request.params.top_logprobs, top_width);
    for (int64_t j = 0; j < k; ++j) {
      best.push_back({top_ids.data_ptr<int64_t>()[i * top_width + j], top_values.data_ptr<float>()[i * top_width + j]});
    }
    Append(*d.request, *d.sample, token[i], model_lp[i], sampling_lp[i], std::move(best));
  }
}

void SamplerEngine::Finish(Request& r) {
  size_t longest = 0;
  for (const Sample& s : r.samples) longest = std::max(longest, s.out.tokens.size());
  if (longest > 1) {
    r.result.time_per_output_token_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - r.first_token).count() /
        static_cast<double>(longest - 1);
  }
  for (Sample& s : r.samples) r.result.sequences.push_back(std::move(s.out));
  reserved_blocks_ -= r.worst_blocks;
  reserved_states_ -= r.worst_states;
  finished_[r.id] = std::move(r.result);
}

absl::Status SamplerEngine::Step(CommGroup* tensor_group) {
  // A LibTorch error (or a failed collective) inside the forward becomes a status.
  return GuardTorch([&] { return StepOnce(tensor_group); });
}

absl::Status SamplerEngine::StepOnce(CommGroup* tensor_group) {
  Admit();
  last_step_ = StepFigures();
  if (running_.empty()) return absl::OkStatus();
  at::NoGradGuard no_grad;
  // This step's work: one decode token of every running sample, then prompt chunks.
  struct Item {
    Request* request;
    Sample* sample;  // null: a prompt chunk
    int64_t tokens;
  };
  int64_t budget = options_.max_tokens_per_step;
  std::vector<Item> items;
  for (auto& r : running_) {
    for (Sample& s : r->samples) {
      if (!s.done && budget > 0) items.push_back({r.get(), &s, 1}), --budget;
    }
  }
  for (auto& r : running_) {
    if (!r->samples.empty() || budget == 0) continue;
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(r->request.prompt.size()) - r->prompt.length, budget);
    items.push_back({r.get(), nullptr, n});
    budget -= n;
  }
  for (const Item& it : items) (it.sample != nullptr ? last_step_.decode_tokens : last_step_.prefill_tokens) += it.tokens;
  // The adapters of this step's items, in order of first appearance; their items' rows lie
  // together, adapter after adapter. Several adapters share one forward as run segments
  // (each its own LoRA over its rows, the frozen base once over all) where the model allows
  // it (dense layers, LoRA adapters); else one forward each.
  std::vector<const Adapter*> adapters;
  for (const Item& it : items) {
    if (std::find(adapters.begin(), adapters.end(), it.request->adapter) == adapters.end()) {
      adapters.push_back(it.request->adapter);
    }
  }
  bool segmented = adapters.size() > 1 && !config_.is_moe();
  for (const Adapter* a : adapters) segmented = segmented && (a == nullptr || !a->full_finetune());
  std::vector<std::vector<const Adapter*>> forwards;
  if (segmented) {
    forwards.push_back(adapters);
  } else {
    for (const Adapter* a : adapters) forwards.push_back({a});
  }
  const at::Device device = weights_.output_weight().device();
  for (const std::vector<const Adapter*>& forward_adapters : forwards) {
    std::vector<int64_t> tokens, positions;
    std::vector<int32_t> starts = {0};
    std::vector<const KvSequence*> sequences;
    SequenceRecurrence recurrence;  // the linear-attention layers' states (Qwen3.5)
    std::vector<int64_t> new_tokens;
    std::vector<const Item*> group;
    std::vector<RunSegment> segments;
    int64_t max_position = 0;
    for (const Adapter* adapter : forward_adapters) {
      const int64_t segment_begin = static_cast<int64_t>(tokens.size());
      for (const Item& it : items) {
        if (it.request->adapter != adapter) continue;
        KvSequence& kv = it.sample != nullptr ? it.sample->kv : it.request->prompt;
        const int64_t end = kv.length + it.tokens;
        if (pool_->BlocksFor(end) > static_cast<int64_t>(kv.blocks.size())) {
          absl::StatusOr<std::vector<int32_t>> more =
              pool_->Allocate(pool_->BlocksFor(end) - static_cast<int64_t>(kv.blocks.size()));
          if (!more.ok()) {
            return absl::InternalError(
                absl::StrCat("sampler: admitted request short of blocks: ", more.status().message()));
          }
          kv.blocks.insert(kv.blocks.end(), more->begin(), more->end());
        }
        for (int64_t j = 0; j < it.tokens; ++j) {
          tokens.push_back(it.sample != nullptr ? it.sample->next_input : it.request->request.prompt[kv.length + j]);
          positions.push_back(kv.length + j);
        }
        max_position = std::max(max_position, end);
        starts.push_back(starts.back() + static_cast<int32_t>(it.tokens));
        sequences.push_back(&kv);
        recurrence.sequences.push_back(&kv);
        new_tokens.push_back(it.tokens);
        group.push_back(&it);
      }
      RunSegment segment;
      segment.adapter = adapter;
      segment.begin = segment_begin;
      segment.end = static_cast<int64_t>(tokens.size());
      segments.push_back(segment);
    }
    PackedSequences packed;
    packed.cu_seqlens = at::tensor(starts, at::kInt).to(device);
    packed.positions = at::tensor(positions, at::kLong).to(device);
    packed.lengths = new_tokens;
    packed.max_length = max_position;
    KvStepAttention attention(pool_, sequences, new_tokens);
    ForwardOptions forward;
    forward.training = false;
    forward.packed = &packed;
    forward.cached_attention = &attention;
    if (config_.HasLinearAttention()) forward.recurrent_states = &recurrence;
    if (segmented) forward.run_segments = &segments;
    if (tensor_group != nullptr && shard_ != nullptr && shard_->tp > 1) {
      forward.shard = shard_;
      forward.tensor_group = tensor_group;
    }
    const VocabShard vocab{forward.tensor_group, shard_ != nullptr ? shard_->vocab_begin : 0};
    const at::Tensor row = at::tensor(tokens, at::kLong).to(device).unsqueeze(0);
    const Adapter* model_adapter = segmented ? nullptr : forward_adapters.front();
    const at::Tensor hidden = Qwen2Hidden(config_, weights_, model_adapter, row, forward)[0];  // [T, H]
    // The rows whose logits are wanted: every decode row; a prompt chunk's rows when its
    // prompt log-probs are asked, else only the prompt's last row. Each under its adapter's head.
    std::vector<int64_t> wanted;
    std::vector<const Adapter*> wanted_adapter;
    int64_t first = 0;
    for (const Item* it : group) {
      const bool last_chunk = it->sample == nullptr && it->request->prompt.length + it->tokens ==
                                                           static_cast<int64_t>(it->request->request.prompt.size());
      if (it->sample != nullptr || (last_chunk && !it->request->request.params.prompt_logprobs)) {
        wanted.push_back(first + it->tokens - 1);
      } else if (it->request->request.params.prompt_logprobs) {
        for (int64_t j = 0; j < it->tokens; ++j) wanted.push_back(first + j);
      }
      wanted_adapter.resize(wanted.size(), it->request->adapter);
      first += it->tokens;
    }
    std::vector<at::Tensor> parts;
    for (const Adapter* adapter : forward_adapters) {
      std::vector<int64_t> rows;
      for (size_t w = 0; w < wanted.size(); ++w) {
        if (wanted_adapter[w] == adapter) rows.push_back(wanted[w]);
      }
      if (rows.empty()) continue;
      const at::Tensor picked = hidden.index_select(0, at::tensor(rows, at::kLong).to(device));
      parts.push_back(Qwen2HeadLogits(weights_, adapter, picked, vocab, config_.vocab_size));
    }
    // The adapters' rows lie in adapter order, so the parts concatenate in `wanted` order.
    const at::Tensor logits = parts.empty() ? at::Tensor() : at::cat(parts, 0);
    // The positions advance; prompts whose last chunk ran fork into their samples. Then
    // every draw of this forward (a decoding sample's next token, a forked sample's first)
    // and every prompt log-prob asked for is computed on the device together.
    std::vector<Draw> draws;
    std::vector<PromptLogprob> prompt_lps;
    int64_t at_row = 0;
    for (const Item* it : group) {
      Request& r = *it->request;
      if (it->sample != nullptr) {
        it->sample->kv.length += 1;
        draws.push_back({&r, it->sample, at_row++});
        continue;
      }
      const int64_t begin = r.prompt.length;
      r.prompt.length += it->tokens;
      r.result.prefill_tokens += it->tokens;
      const int64_t prompt_length = static_cast<int64_t>(r.request.prompt.size());
      if (r.request.params.prompt_logprobs) {
        for (int64_t j = 0; j < it->tokens; ++j, ++at_row) {
          if (begin + j + 1 < prompt_length) prompt_lps.push_back({&r, at_row, r.request.prompt[begin + j + 1]});
        }
      } else if (r.prompt.length == prompt_length) {
        ++at_row;
      }
      if (r.prompt.length == prompt_length) {
        if (absl::Status s = Fork(r); !s.ok()) return s;
        for (Sample& s : r.samples) draws.push_back({&r, &s, at_row - 1});
      }
    }
    ApplyDraws(logits, draws, prompt_lps);
  }
  // Requests whose samples all finished.
  std::vector<std::unique_ptr<Request>> still;
  for (auto& r : running_) {
    const bool done = !r->samples.empty() && std::all_of(r->samples.begin(), r->samples.end(),
                                                         [](const Sample& s) { return s.done; });
    if (done) {
      Finish(*r);
    } else {
      still.push_back(std::move(r));
    }
  }
  running_ = std::move(still);
  return absl::OkStatus();
}

std::optional<SampleResult> SamplerEngine::Take(int64_t id) {
  auto it = finished_.find(id);
  if (it == finished_.end()) return std::nullopt;
  SampleResult out = std::move(it->second);
  finished_.erase(it);
  return out;
}

void SamplerEngine::Cancel(int64_t id) {
  finished_.erase(id);
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), [&](const auto& r) { return r->id == id; }),
                 waiting_.end());
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if ((*it)->id != id) continue;
    Release((*it)->prompt);
    for (Sample& s : (*it)->samples) Release(s.kv);
    reserved_blocks_ -= (*it)->worst_blocks;
    reserved_states_ -= (*it)->worst_states;
    running_.erase(it);
    return;
  }
}

int64_t SamplerEngine::running_sequences() const {
  int64_t n = 0;
  for (const auto& r : running_) {
    n += r->samples.empty() ? 1 : std::count_if(r->samples.begin(), r->samples.end(), [](const Sample& s) { return !s.done; });
  }
  return n;
}

}  // namespace lorastep
