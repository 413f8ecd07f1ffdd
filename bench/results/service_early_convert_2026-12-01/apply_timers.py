# Temporary per-phase timers (not committed code): python3 apply_timers.py, run, git checkout the files.
import re
HDR = '''#include <chrono>
#include <cstdio>
#include <string>
namespace lorastep_phase {
inline thread_local std::chrono::steady_clock::time_point last;
inline thread_local std::string line;
inline void Start() { last = std::chrono::steady_clock::now(); line.clear(); }
inline void Mark(const char* name) {
  auto now = std::chrono::steady_clock::now();
  char buf[64];
  snprintf(buf, sizeof buf, " %s=%.3f", name, std::chrono::duration<double, std::milli>(now - last).count());
  line += buf;
  last = now;
}
inline void Print(const char* what) { fprintf(stderr, "PHASES %s%s\\n", what, line.c_str()); }
}
'''
def patch(path, reps, header=True):
    s = open(path).read()
    if header:
        i = s.index('\n', s.index('#include')) + 1
        s = s[:i] + HDR + s[i:]
    for a, b in reps:
        assert s.count(a) == 1, (path, a)
        s = s.replace(a, b)
    open(path, 'w').write(s)

patch('server/coordinator_service.cc', [
 ('''  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  executor_.Submit(server_id, [this, reactor, resp, server_id, call = std::move(call), who = *caller]() mutable {
    auto result = call(who, server_id);
    if (result.ok()) *resp = std::move(result).value();
    Done(server_id);
    reactor->Finish(ToGrpcStatus(result.status()));
  });''','''  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto submitted = std::chrono::steady_clock::now();
  executor_.Submit(server_id, [this, reactor, resp, server_id, submitted, call = std::move(call), who = *caller]() mutable {
    lorastep_phase::last = submitted; lorastep_phase::line.clear();
    auto result = call(who, server_id);
    lorastep_phase::Mark("call_return");
    if (result.ok()) *resp = std::move(result).value();
    Done(server_id);
    lorastep_phase::Mark("resp_move");
    reactor->Finish(ToGrpcStatus(result.status()));
    lorastep_phase::Mark("finish");
    lorastep_phase::Print("coordinator");
  });'''),
 ('''    return core_->TrainStep(ServerRequest(*req, who, id, &copy), datums);''','''    lorastep_phase::Mark("queued");
    return core_->TrainStep(ServerRequest(*req, who, id, &copy), datums);'''),
])
patch('server/coordinator.cc', [
 ('''  FingerprintTask fingerprint(req.run_id(), req);
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  if (req.max_tokens_per_microbatch() < 0) {''','''  lorastep_phase::Mark("replay");
  FingerprintTask fingerprint(req.run_id(), req);
  lorastep_phase::Mark("fp_spawn");
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  if (req.max_tokens_per_microbatch() < 0) {'''),
 ('''  LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum> datums, TakeDatums(req, unpacked));
  LORASTEP_ASSIGN_OR_RETURN(const std::optional<BatchTotals> totals,
                            ValidatedTotals(*run, datums, req.loss(), /*own_totals_needed=*/false));''','''  lorastep_phase::Mark("checks");
  LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum> datums, TakeDatums(req, unpacked));
  lorastep_phase::Mark("unpack");
  LORASTEP_ASSIGN_OR_RETURN(const std::optional<BatchTotals> totals,
                            ValidatedTotals(*run, datums, req.loss(), /*own_totals_needed=*/false));
  lorastep_phase::Mark("validate");'''),
 ('''        wreq.mutable_mesh()->set_mesh_generation(mesh_generation_);
        return w->TrainStep(wreq, BatchShard{&datums, &ShardOfRank(shards, rank)});
      }));
  LORASTEP_ASSIGN_OR_RETURN(resp, MergeSteps(*run, std::move(per_rank)));
  AddClientMetrics(req.client_metrics(), &resp);
  run->current_fingerprint = fingerprint.Get();
  CommitStep(*run, "TrainStep", "train_step", req.request_id(), &resp);''','''        wreq.mutable_mesh()->set_mesh_generation(mesh_generation_);
        lorastep_phase::Mark("build_wreq");
        auto r = w->TrainStep(wreq, BatchShard{&datums, &ShardOfRank(shards, rank)});
        lorastep_phase::Mark("w_return");
        return r;
      }));
  lorastep_phase::Mark("fanout_end");
  LORASTEP_ASSIGN_OR_RETURN(resp, MergeSteps(*run, std::move(per_rank)));
  lorastep_phase::Mark("merge");
  AddClientMetrics(req.client_metrics(), &resp);
  run->current_fingerprint = fingerprint.Get();
  lorastep_phase::Mark("fp_join");
  CommitStep(*run, "TrainStep", "train_step", req.request_id(), &resp);
  lorastep_phase::Mark("commit");'''),
])
patch('worker/worker_calls.cc', [
 ('''  return Once(req.mesh(), "TrainStep", resp, [&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req.loss()));''','''  lorastep_phase::Mark("w_enter");
  return Once(req.mesh(), "TrainStep", resp, [&]() -> absl::Status {
    lorastep_phase::Mark("w_once_in");
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req.loss()));'''),
 ('''                              core_->TrainStep(req.run_id(), *datums, loss, adamw, totals ? &*totals : nullptr,
                                               req.max_tokens_per_microbatch(), MeshFromProto(req.mesh())));
    FillStepResponse(r, resp);
    RecordStepMetrics(metrics_, req.run_id(), "train_step", resp->result().metrics(), r.learner_version);
    return absl::OkStatus();''','''                              core_->TrainStep(req.run_id(), *datums, loss, adamw, totals ? &*totals : nullptr,
                                               req.max_tokens_per_microbatch(), MeshFromProto(req.mesh())));
    lorastep_phase::Mark("w_core");
    FillStepResponse(r, resp);
    lorastep_phase::Mark("w_fill");
    RecordStepMetrics(metrics_, req.run_id(), "train_step", resp->result().metrics(), r.learner_version);
    lorastep_phase::Mark("w_metrics");
    return absl::OkStatus();'''),
])
patch('clients/cpp/trainer_client.cc', [
 ('''  v1::TrainStepRequest req;
  req.set_run_id(run_id_);
  SetDatums(datums, &req);
  *req.mutable_loss() = loss;
  *req.mutable_adamw() = adamw;
  req.set_max_tokens_per_microbatch(max_tokens_per_microbatch);
  return Mutate<v1::StepResponse>([&](const std::string& rid, int64_t seq) {
    req.set_request_id(rid);
    req.set_sequence_id(seq);
    return client_->TrainStep(req);
  });''','''  lorastep_phase::Start();
  v1::TrainStepRequest req;
  req.set_run_id(run_id_);
  SetDatums(datums, &req);
  *req.mutable_loss() = loss;
  *req.mutable_adamw() = adamw;
  req.set_max_tokens_per_microbatch(max_tokens_per_microbatch);
  lorastep_phase::Mark("c_build");
  auto out = Mutate<v1::StepResponse>([&](const std::string& rid, int64_t seq) {
    req.set_request_id(rid);
    req.set_sequence_id(seq);
    return client_->TrainStep(req);
  });
  lorastep_phase::Mark("c_call");
  lorastep_phase::Print("client");
  return out;'''),
])
