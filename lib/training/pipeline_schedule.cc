// Trainer::RunPipelineSchedule: a pipeline stage's part of a call's micro-batches (Megatron's
// 1F1B for training, all forwards for a forward-only call), with the point-to-point exchanges
// between neighbouring stages.
#include <algorithm>
#include <chrono>
#include <deque>

#include "lib/status_macros.h"
#include "lib/training/trainer.h"

namespace lorastep {

absl::Status Trainer::RunPipelineSchedule(
    int num_micro_batches, bool backward,
    const std::function<std::vector<int64_t>(int)>& activation_shape,
    const std::function<at::Tensor(int, const at::Tensor&)>& forward,
    const std::function<absl::Status(int)>& stop_before, double* t_forward, double* t_backward) {
  constexpr int kActivationTag = 0, kGradientTag = 1;
  CommGroup& pipe = options_.groups->group(GroupKind::kPipeline);
  const bool first = base_->shard.first_stage(), last = base_->shard.last_stage();
  const int prev = pipe.rank() - 1, next = pipe.rank() + 1;
  const at::TensorOptions act = at::TensorOptions().device(base_->device).dtype(base_->dtype);
  struct InFlight {
    int index;
    at::Tensor input;   // received activation (a leaf that collects its gradient)
    at::Tensor output;  // stage output, or the loss on the last stage
  };
  std::deque<InFlight> in_flight;

  auto receive_input = [&](int i) -> absl::StatusOr<at::Tensor> {
    if (first) return at::Tensor();
    at::Tensor x = at::empty(activation_shape(i), act);
    LORASTEP_RETURN_IF_ERROR(pipe.Recv(x, prev, kActivationTag));
    if (backward) x.requires_grad_(true);
    return x;
  };
  auto run_forward = [&](int i, const at::Tensor& x) {
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor y = forward(i, x);
    SyncDevice();
    *t_forward += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    in_flight.push_back({i, x, y});
    return y;
  };
  // Backward of the oldest micro-batch given its output gradient; returns its input's.
  auto run_backward = [&](const at::Tensor& grad_output) {
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    const auto t0 = std::chrono::steady_clock::now();
    if (last) {
      f.output.backward();
    } else {
      f.output.backward(grad_output);
    }
    SyncDevice();
    *t_backward += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return first ? at::Tensor() : f.input.grad();
  };
  auto output_grad_buffer = [&]() { return at::empty(activation_shape(in_flight.front().index), act); };

  // `stop_before(i)` comes before this stage receives micro-batch i's input, on every rank in
  // the same order. Between two of those points each stage's sends and receives pair up with
  // its neighbours' of the same span (the forward of micro-batch i runs down the stages; the
  // gradient each stage passes back is the one the stage before receives after its forward of
  // i), so a collective there waits for nothing that comes after it, and a stop leaves no
  // send or receive half done.
  if (!backward) {
    for (int i = 0; i < num_micro_batches; ++i) {
      LORASTEP_RETURN_IF_ERROR(stop_before(i));
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor x, receive_input(i));
      at::Tensor y = run_forward(i, x);
      in_flight.clear();
      if (!last) LORASTEP_RETURN_IF_ERROR(pipe.Send(y, next, kActivationTag));
    }
    return absl::OkStatus();
  }
  const int stages = pipe.size();
  const int warmup = std::min(stages - pipe.rank() - 1, num_micro_batches);
  const int steady = num_micro_batches - warmup;
  for (int i = 0; i < warmup; ++i) {
    LORASTEP_RETURN_IF_ERROR(stop_before(i));
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor x, receive_input(i));
    at::Tensor y = run_forward(i, x);
    LORASTEP_RETURN_IF_ERROR(pipe.Send(y.detach(), next, kActivationTag));
  }
  at::Tensor x;
  if (steady > 0) {
    LORASTEP_RETURN_IF_ERROR(stop_before(warmup));
    LORASTEP_ASSIGN_OR_RETURN(x, receive_input(warmup));
  }
  for (int j = 0; j < steady; ++j) {
    const int i = warmup + j;
    at::Tensor y = run_forward(i, x);
    at::Tensor grad_output;
    if (!last) {  // send this output, receive the oldest output's gradient
      grad_output = output_grad_buffer();
      at::Tensor y_out = y.detach();
      LORASTEP_RETURN_IF_ERROR(pipe.SendRecv(&y_out, next, kActivationTag, &grad_output, next, kGradientTag));
    }
    at::Tensor grad_input = run_backward(grad_output);
    if (j == steady - 1) {
      if (!first) LORASTEP_RETURN_IF_ERROR(pipe.Send(grad_input, prev, kGradientTag));
    } else {
      LORASTEP_RETURN_IF_ERROR(stop_before(i + 1));
      if (!first) {  // send the input gradient, receive the next input
        x = at::empty(activation_shape(i + 1), act);
        LORASTEP_RETURN_IF_ERROR(pipe.SendRecv(&grad_input, prev, kGradientTag, &x, prev, kActivationTag));
        x.requires_grad_(true);
      }
    }
  }
  for (int k = 0; k < warmup; ++k) {
    at::Tensor grad_output = output_grad_buffer();
    LORASTEP_RETURN_IF_ERROR(pipe.Recv(grad_output, next, kGradientTag));
    at::Tensor grad_input = run_backward(grad_output);
    if (!first) LORASTEP_RETURN_IF_ERROR(pipe.Send(grad_input, prev, kGradientTag));
  }
  return absl::OkStatus();
}

}  // namespace lorastep
