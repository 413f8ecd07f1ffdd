"""The Tinker-compatible front driven by the official Tinker SDK itself (its ServiceClient,
TrainingClient, SamplingClient and RestClient, unmodified), against a real coordinator and
worker on loopback (CPU, a small generated model, one API key and a second key for the
isolation case). Not part of CI: the SDK is not a Debian package. Put its `src` folder (with a
`tinker-<version>.dist-info/METADATA`, which its version lookup needs) and its dependencies on
PYTHONPATH, then:

  python3 bench/tinker_sdk_check.py COORDINATOR WORKER GENMODEL [--out RESULT.json]

Prints one line per case and `sdk_cases=N`, `sdk_passed=M`; exits 1 unless all pass; with
--out writes the figures with the date, machine, SDK version and command."""
import argparse
import asyncio
import datetime
import hashlib
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from case_runner import run_cases  # noqa: E402
from wait_for import wait_for  # noqa: E402

try:
    import tinker
    from tinker import types
except ImportError as e:
    sys.exit(f"the Tinker SDK is not importable ({e}): see this script's docstring")

KEY, OTHER_KEY = "tml-sdkcheck-0123456789abcdef", "tml-sdkother-0123456789abcdef"
PROMPT = [5, 6, 7, 8]


def datum(i, length=9):
    tokens = [(i * 7 + j * 3) % 200 + 1 for j in range(length)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)})


class Ctx:
    pass


CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def adapter_sha(ctx, tc, name):
    """SHA-256 of the adapter weights in the archive of `tc`'s sampler save `name`."""
    path = tc.save_weights_for_sampler(name).result().path
    url = ctx.rest.get_checkpoint_archive_url_from_tinker_path(path).result().url
    archive = tarfile.open(fileobj=io.BytesIO(urllib.request.urlopen(url).read()))
    return hashlib.sha256(archive.extractfile("adapter_model.safetensors").read()).hexdigest()


@case
def capabilities(ctx):
    caps = ctx.service.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == ["tiny/base"], caps


@case
def supervised_loop_loss_falls(ctx):
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=8, seed=1)
    assert tc.get_info().model_data.model_name == "tiny/base"
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([datum(i) for i in range(8)], "cross_entropy").result()
        assert len(fb.loss_fn_outputs) == 8 and "logprobs" in fb.loss_fn_outputs[0]
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.metrics["loss:sum"])
    assert losses[-1] < losses[0], losses


@case
def chunked_forward_backward(ctx):
    # 1,100 datums: the SDK splits them into chunks (at most 1,024 each) posted concurrently.
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=4, seed=2)
    big = [datum(i) for i in range(1100)]
    whole = tc.forward_backward(big, "cross_entropy").result()
    assert len(whole.loss_fn_outputs) == 1100
    parts = sum(tc.forward_backward(big[k:k + 550], "cross_entropy").result().metrics["loss:sum"] for k in (0, 550))
    assert abs(whole.metrics["loss:sum"] - parts) <= 1e-6 * abs(parts), (whole.metrics["loss:sum"], parts)


@case
def rl_loop_every_loss(ctx):
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=8, seed=3)
    sampler = tc.save_weights_and_get_sampling_client()
    res = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=4,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=1)).result()
    assert len(res.sequences) == 4
    data = []
    for s in res.sequences:
        assert len(s.tokens) == 6 and len(s.logprobs) == 6 and s.stop_reason == "length", s
        tokens = PROMPT + list(s.tokens)
        pad = len(PROMPT) - 1
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * pad + list(s.logprobs),
                                                "advantages": [0.0] * pad + [1.0] * len(s.tokens)}))
    for loss in ("importance_sampling", "ppo", "cispo", "dro"):
        fb = tc.forward_backward(data, loss).result()
        assert "loss:sum" in fb.metrics and len(fb.loss_fn_outputs) == 4, (loss, fb.metrics)
    # On policy: the ratio is 1 everywhere, so importance sampling's loss is -sum(advantages).
    fb = tc.forward_backward(data, "importance_sampling").result()
    assert abs(fb.metrics["loss:sum"] + 24.0) < 1e-3, fb.metrics
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + [9])).result()
    assert lp[0] is None and len(lp) == 5 and all(x < 0 for x in lp[1:]), lp
    top = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT + [9]), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                         topk_prompt_logprobs=3).result()
    assert top.topk_prompt_logprobs[0] is None and len(top.topk_prompt_logprobs) == 5, top.topk_prompt_logprobs
    assert all(len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1] for row in top.topk_prompt_logprobs[1:])


@case
def resume_with_optimizer_is_bitwise(ctx):
    big = [datum(i) for i in range(64)]
    a = ctx.service.create_lora_training_client(base_model="tiny/base", rank=4, seed=4)
    a.forward_backward(big, "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state = a.save_state("mid").result().path
    b = ctx.service.create_training_client_from_state_with_optimizer(state)
    for tc in (a, b):
        tc.forward_backward(big[:16], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert adapter_sha(ctx, a, "resume-a") == adapter_sha(ctx, b, "resume-b")


@case
def from_state_keeps_the_lora_targets(ctx):
    # A model without attention LoRA but with the LM head's: create_training_client_from_state
    # makes the new model from weights_info's switches, and the load needs the same targets.
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=4, seed=9, train_attn=False,
                                                 train_unembed=True)
    tc.forward_backward([datum(i) for i in range(4)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state("targets").result().path
    info = ctx.rest.get_weights_info_by_tinker_path(path).result()
    assert (info.train_attn, info.train_mlp, info.train_unembed, info.lora_rank) == (False, True, True, 4), info
    resumed = ctx.service.create_training_client_from_state(path)
    assert resumed.get_info().model_id != tc.get_info().model_id


@case
def sampler_checkpoint_archive_and_listing(ctx):
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=4, seed=5)
    path = tc.save_weights_for_sampler("kept").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/kept"), path
    sampled = ctx.service.create_sampling_client(model_path=path).sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=types.SamplingParams(max_tokens=3))
    assert len(sampled.result().sequences[0].tokens) == 3
    url = ctx.rest.get_checkpoint_archive_url_from_tinker_path(path).result().url
    names = tarfile.open(fileobj=io.BytesIO(urllib.request.urlopen(url).read())).getnames()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(names), names
    run_id = tc.get_info().model_id
    assert run_id in [r.training_run_id for r in ctx.rest.list_training_runs().result().training_runs]
    listed = [c.tinker_path for c in ctx.rest.list_checkpoints(run_id).result().checkpoints]
    assert path in listed, listed
    ctx.rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in [c.tinker_path for c in ctx.rest.list_checkpoints(run_id).result().checkpoints]


@case
def sessions_list_their_models(ctx):
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=4, seed=10)
    model_id = tc.get_info().model_id
    sessions = ctx.rest.list_sessions(limit=1000).result().sessions
    owning = [s for s in sessions if model_id in ctx.rest.get_session(s).result().training_run_ids]
    assert len(owning) == 1, (sessions, model_id)
    other = tinker.ServiceClient(base_url=ctx.base_url, api_key=OTHER_KEY).create_rest_client()
    refused(lambda: other.get_session(owning[0]).result(), tinker.NotFoundError, "")


@case
def async_api(ctx):
    async def go():
        tc = await ctx.service.create_lora_training_client_async(base_model="tiny/base", rank=4, seed=6)
        fb = await tc.forward_backward_async([datum(i) for i in range(4)], "cross_entropy")
        op = await tc.optim_step_async(types.AdamParams(learning_rate=1e-3))
        return (await fb.result_async()).metrics, (await op.result_async()).metrics
    fb, op = asyncio.run(go())
    assert "loss:sum" in fb and "grad_norm:sum" in op, (fb, op)


def refused(call, error_class, text):
    try:
        call()
    except error_class as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"accepted, or not {error_class.__name__}")


@case
def bad_inputs_refused_in_the_sdks_shapes(ctx):
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=4, seed=7)
    refused(lambda: tc.forward_backward([datum(0)], "nope").result(), tinker.BadRequestError, "loss_fn")
    wide = types.Datum(model_input=types.ModelInput.from_ints([1, 10**6]),
                       loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    refused(lambda: tc.forward_backward([wide], "cross_entropy").result(), tinker.RequestFailedError, "outside")
    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    refused(lambda: tc.forward_backward([short], "cross_entropy").result(), tinker.BadRequestError,
            "2 rows for 3 tokens")
    refused(lambda: ctx.service.create_lora_training_client(base_model="nope/x", rank=4), tinker.BadRequestError,
            "base_model")


@case
def another_keys_model_is_not_found(ctx):
    tc = ctx.service.create_lora_training_client(base_model="tiny/base", rank=4, seed=8)
    path = tc.save_weights_for_sampler("mine").result().path
    other = tinker.ServiceClient(base_url=ctx.base_url, api_key=OTHER_KEY)
    refused(lambda: other.create_sampling_client(model_path=path).sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=2)).result(), tinker.NotFoundError, "")
    refused(lambda: other.create_rest_client().list_checkpoints(tc.get_info().model_id).result(),
            tinker.NotFoundError, "")


def module_versions():
    import importlib
    out = {}
    for name in ("pydantic", "httpx", "anyio", "orjson", "numpy", "google.protobuf", "zstandard"):
        try:
            out[name] = importlib.import_module(name).__version__
        except (ImportError, AttributeError):
            out[name] = None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("coordinator")
    ap.add_argument("worker")
    ap.add_argument("genmodel")
    ap.add_argument("--out")
    ap.add_argument("--sdk-source", default="", help="where the SDK's source came from (recorded with --out)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    model = os.path.join(tmp, "model")
    subprocess.run([args.genmodel, "--preset", "small", "--out", model], check=True, stdout=subprocess.DEVNULL)
    keys = os.path.join(tmp, "keys")
    with open(keys, "w") as f:
        f.write(f"{KEY} sdk-user\n{OTHER_KEY} other-user\n")
    port_file = os.path.join(tmp, "tinker_port")
    log = open(os.path.join(tmp, "coordinator.log"), "w")
    proc = subprocess.Popen([args.coordinator, "--model", model, "--worker_binary", args.worker, "--port", "0",
                             "--nojournal", "--state_dir", os.path.join(tmp, "state"), "--api_keys_file", keys,
                             "--tinker_port", "0", "--tinker_port_file", port_file, "--tinker_model_name", "tiny/base"],
                            stderr=log)
    passed = 0
    try:
        if not wait_for(lambda: os.path.exists(port_file) and open(port_file).read().strip() or proc.poll() is not None,
                        seconds=120) or proc.poll() is not None:
            sys.exit("the coordinator exited or wrote no port: see " + log.name)
        ctx = Ctx()
        ctx.base_url = f"http://127.0.0.1:{open(port_file).read().strip()}"
        ctx.service = tinker.ServiceClient(base_url=ctx.base_url, api_key=KEY)
        ctx.rest = ctx.service.create_rest_client()
        passed = run_cases(CASES, ctx, passed="PASS {}", failed="FAIL {}\n{}")
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"sdk_cases={len(CASES)}\nsdk_passed={passed}")
    if args.out:
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.platform()})",
            "library_versions": dict({"tinker_sdk": tinker.__version__, "python": platform.python_version()},
                                     **module_versions()),
            "sdk_source": args.sdk_source,
            "command": "python3 " + " ".join(sys.argv),
            "sdk_cases": len(CASES), "sdk_passed": passed, "cases": [fn.__name__ for fn in CASES],
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    sys.exit(0 if passed == len(CASES) else 1)


if __name__ == "__main__":
    main()
