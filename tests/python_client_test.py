"""The Python client drives a full loop against a running coordinator (started by
python_client_test.sh): create, forward, forward_backward + optim_step, train_step,
metrics, watch, save/load, export, sampling, and validation errors."""
import os
import sys
import threading

from lorastep import (AdamWParams, Datum, LorastepError, LossConfig, SampleResult, SamplingParams, StepResult,
                      TrainingClient)


def datum(i, n=10, vocab=96):
    return {"tokens": [(i * 7 + j * 3) % vocab for j in range(n)],
            "target_tokens": [(i * 5 + j * 11) % vocab for j in range(n)],
            "logprobs": [-4.0] * n,
            "advantages": [0.0, 0.0] + [1.0 if i % 2 else -0.5] * (n - 2)}


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok -", what)


def main():
    address, tmp = sys.argv[1], sys.argv[2]
    client = TrainingClient(address)
    run = client.create_run(rank=4, alpha=8, seed=3)
    head = client.create_run(rank=4, alpha=8, seed=3, train_unembed=True, train_mlp=False)
    info = [r for r in client.list_runs() if r.run_id == head.run_id]
    check(len(info) == 1 and info[0].target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "linear_attn",
                                                        "lm_head"],
          "train_unembed=True, train_mlp=False: attention and the LM head")
    client.delete_run(head.run_id)
    check(any(r.run_id == run.run_id for r in client.list_runs()), "run listed")
    batch = [datum(i) for i in range(4)]
    fwd = run.forward(batch)
    check(len(fwd["logprobs"]) == 4 and len(fwd["logprobs"][0]) == 10, "forward log-probs shape")
    for d, lp in zip(batch, fwd["logprobs"]):
        d["old_logprobs"] = lp
    fb = run.forward_backward(batch, loss={"loss_fn": "ppo"})
    check(abs(fb["metrics"]["ppo_kl:mean"]) < 1e-6, "on-policy ppo_kl ~ 0 at step 0")
    step = run.optim_step(adamw={"lr": 1e-2})
    check(step["learner_version"] == 1, "optim_step bumps the learner version")
    records = []
    watcher_ready = threading.Event()

    def watch():
        for r in run.watch():
            records.append(r["step"])
            watcher_ready.set()
            if len(records) == 3:
                break

    t = threading.Thread(target=watch)
    t.start()
    watcher_ready.wait(10)
    for _ in range(2):
        out = run.train_step(batch, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-2})
    t.join(30)
    check(records == [0, 1, 2], f"watch streamed backlog and new steps {records}")
    check(out["learner_version"] == 3 and len(out["adapter_sha256"]) == 64, "train_step result")
    hist = run.metrics()
    check([h["step"] for h in hist] == [0, 1, 2] and "loss:sum" in hist[-1]["metrics"],
          "metric history")
    ckpt = os.path.join(tmp, "ckpt")
    run.save(ckpt)
    run.train_step(batch, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-2})
    check(run.load(ckpt) == 3, "load restores the learner version")
    exported = run.export(os.path.join(tmp, "peft"))
    check(exported["adapter_sha256"] == out["adapter_sha256"], "export publishes the restored adapter")
    check(os.path.exists(os.path.join(tmp, "peft", "adapter_model.safetensors")), "PEFT files")
    bad = [dict(batch[0])]
    bad[0]["advantages"] = [float("nan")] * 10
    try:
        run.train_step(bad, loss={"loss_fn": "ppo"})
        raise AssertionError("a NaN advantage was accepted")
    except LorastepError as e:
        check(e.code.name == "INVALID_ARGUMENT" and "datums[0].advantages[0]" in e.details,
              "validation error names the field")
    try:
        run.train_step(batch, loss={"loss_fn": "nope"})
        raise AssertionError("an unknown loss was accepted")
    except LorastepError as e:
        check(e.code.name == "INVALID_ARGUMENT" and "loss_fn" in e.details, "unknown loss refused")
    for bad_metrics, field in (({"reward!": 1.0}, "client_metrics: name 'reward!'"),
                               ({"reward": float("inf")}, "client_metrics[reward]"),
                               ({f"m{i}": 1.0 for i in range(33)}, "client_metrics: 33 entries")):
        try:
            run.train_step(batch, loss={"loss_fn": "ppo"}, client_metrics=bad_metrics)
            raise AssertionError(f"client_metrics {bad_metrics} accepted")
        except LorastepError as e:
            check(e.code.name == "INVALID_ARGUMENT" and field in e.details, f"refused: {e.details}")
    check(run.metrics()[-1]["step"] == 3, "refused client_metrics applied nothing")
    try:
        run.train_step(batch, loss={"loss_fn": "ppo"}, activation_recompute="sometimes")
        raise AssertionError("an unknown activation_recompute was accepted")
    except LorastepError as e:
        check(e.code.name == "INVALID_ARGUMENT" and "activation_recompute" in e.details, "unknown recompute refused")
    fb = run.forward_backward(batch, loss={"loss_fn": "ppo"}, activation_recompute="full")
    check(fb.metrics["micro_batches_recomputed:sum"] > 0, "the call's activation_recompute reaches the worker")
    run.optim_step()
    again = client.attach(run.run_id)
    stepped = again.train_step(batch, loss={"loss_fn": "ppo"}, client_metrics={"reward": 0.25, "eval/acc": 0.5})
    check(stepped["learner_version"] == 5, "a second client continues the run's sequence")
    last = run.metrics()[-1]["metrics"]
    check(last["client:reward"] == 0.25 and last["client:eval/acc"] == 0.5 and
          stepped["metrics"]["client:reward"] == 0.25, "client_metrics kept in the step and its history")
    # Packed batches (the default) train bitwise like repeated Datum messages; a batch the
    # packed form cannot carry (weights on one datum only, an id past int32) goes as datums.
    from lorastep.types import batch_fields
    check("packed_datums" in batch_fields(batch) and "datums" in batch_fields(batch, pack=False),
          "a uniform batch is packed unless asked not to")
    mixed = [dict(d) for d in batch]
    mixed[0]["weights"] = [1.0] * 10
    wide = [dict(d) for d in batch]
    wide[1]["tokens"] = [2 ** 32 + 5] * 10
    check("datums" in batch_fields(mixed) and "datums" in batch_fields(wide), "unpackable batches go as datums")
    # Next-token targets (tokens shifted by one) travel as one last target per datum.
    shifted = []
    for i in range(4):
        stream = [(i * 13 + j * 5) % 96 for j in range(11)]
        shifted.append(dict(datum(i), tokens=stream[:-1], target_tokens=stream[1:]))
    packed = batch_fields(shifted)["packed_datums"]
    check(packed.target_tokens == b"" and len(packed.last_target_tokens) == 16,
          "next-token targets are sent as last targets")
    check(batch_fields(batch)["packed_datums"].last_target_tokens == b"", "other targets are sent whole")
    packed_run = client.create_run(rank=4, alpha=8, seed=11)
    plain_run = client.create_run(rank=4, alpha=8, seed=11)
    plain_run.pack_datums = False
    for b in (batch, mixed, shifted):
        a = packed_run.train_step(b, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-2})
        p = plain_run.train_step(b, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-2})
        check(a.adapter_sha256 == p.adapter_sha256 and a.metrics["loss:sum"] == p.metrics["loss:sum"],
              "packed and repeated datums train alike")
    try:
        packed_run.train_step(wide, loss={"loss_fn": "ppo"})
        raise AssertionError("a token id past int32 was accepted")
    except LorastepError as e:
        check("datums[1].tokens[0]: id 4294967301" in e.details, "an id past int32 is refused, not narrowed")
    client.delete_run(packed_run.run_id)
    client.delete_run(plain_run.run_id)
    # Typed requests and results, and futures that keep a run's order.
    typed = [Datum(**datum(i)) for i in range(4)]
    fb = again.forward_backward_async(typed, loss=LossConfig(loss_fn="ppo", clip_eps_low=0.1))
    st = again.optim_step_async(adamw=AdamWParams(lr=1e-3, max_grad_norm=1.0))
    tr = again.train_step_async(typed, loss=LossConfig(loss_fn="ppo"), adamw=AdamWParams(lr=1e-3))
    check(isinstance(st.result(30), StepResult) and st.result().learner_version == 6 and
          tr.result(30).learner_version == 7 and "loss:sum" in fb.result().metrics,
          "async calls on a run complete in submission order with typed results")
    try:
        again.train_step_async([{"tokens": [1], "bogus": [1]}]).result(30)
        raise AssertionError("an unknown datum field was accepted")
    except ValueError as e:
        check("unknown fields ['bogus']" in str(e), "a future carries the call's error")
    # Sampling: a sample_async queued after a train_step_async sees that step; its tokens'
    # log-probs are what forward gives on the returned sequence.
    prompt = [3, 14, 15, 92]
    stepped = again.train_step_async(typed, loss=LossConfig(loss_fn="ppo"), adamw=AdamWParams(lr=1e-3))
    sampled = again.sample_async([prompt], num_samples=2, params=SamplingParams(max_tokens=6, temperature=1.0, seed=9))
    got = sampled.result(60)
    check(isinstance(got, SampleResult) and got.learner_version == stepped.result().learner_version,
          "sample_async after train_step_async samples that step's weights")
    for s in got.sequences[0]:
        full = prompt + s.tokens
        fwd = again.forward([{"tokens": full[:-1], "target_tokens": full[1:]}]).logprobs[0][len(prompt) - 1:]
        check(len(s.tokens) == 6 and s.stop_reason == "length" and
              max(abs(a - b) for a, b in zip(s.logprobs, fwd)) < 1e-5, "sampled log-probs are forward's")
    greedy = again.sample([prompt], params={"max_tokens": 3, "temperature": 0.0})
    check(greedy.sequences[0][0].sampling_logprobs == [0.0] * 3, "greedy: each token with probability 1")
    try:
        again.sample([prompt], params=SamplingParams(top_p=1.5))
        raise AssertionError("top_p 1.5 was accepted")
    except LorastepError as e:
        check("params.top_p" in str(e), f"a bad sampling parameter is refused naming it: {e}")
    again.close()
    client.close()
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()
