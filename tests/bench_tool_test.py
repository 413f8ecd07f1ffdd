"""scripts/bench.py exits non-zero on a failed test, a parity check over its tolerance and a
missing benchmark output, and zero when everything holds; --pack-raw leaves only the results. Real processes: the tool itself,
and ctest over a CTest folder whose tests are real programs (false / true)."""
import json, os, subprocess, sys, unittest

TOOL, TMP = sys.argv[1], sys.argv[2]


def bench(*args):
    out = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout + out.stderr


def folder(name):
    path = os.path.join(TMP, name)
    os.makedirs(path, exist_ok=True)
    return path


def ctest_folder(name, programs):
    """A build folder as CMake leaves it for ctest, with one test per program."""
    path = folder(name)
    with open(os.path.join(path, "CTestTestfile.cmake"), "w") as f:
        for i, program in enumerate(programs):
            f.write(f'add_test(case_{i} "{program}")\n')
    return path


def write(path, data):
    with open(path, "w") as f:
        json.dump(data, f)


class BenchToolTest(unittest.TestCase):
    def test_a_failing_test_fails_the_check(self):
        build = ctest_folder("build_red", ["/bin/true", "/bin/false"])
        rc, out = bench("--build-dir", build, "--out", folder("out_red"), "--device", "cpu", "--dtype", "float32",
                        "check")
        self.assertNotEqual(rc, 0, out)
        self.assertIn("tests on cpu float32", out)

    def test_passing_tests_pass_the_check(self):
        build = ctest_folder("build_green", ["/bin/true", "/bin/true"])
        rc, out = bench("--build-dir", build, "--out", folder("out_green"), "--device", "cpu", "--dtype", "float32",
                        "--dtype", "bfloat16", "check")
        self.assertEqual(rc, 0, out)
        self.assertIn("all steps passed", out)

    def test_the_check_names_the_tests_that_skipped(self):
        build = ctest_folder("build_skip", ["/bin/true"])
        with open(os.path.join(build, "CTestTestfile.cmake"), "a") as f:
            f.write('add_test(case_skip "/bin/sh" "-c" "echo \'[  SKIPPED ] Kernel.OnTheTestDevice (3 ms)\'")\n')
        rc, out = bench("--build-dir", build, "--out", folder("out_skip"), "--device", "cpu", "--dtype", "float32",
                        "check")
        self.assertEqual(rc, 0, out)
        self.assertIn("skipped on cpu float32: 1\n  Kernel.OnTheTestDevice", out)

    def test_parity_over_tolerance_fails(self):
        out_dir = folder("out_parity")
        write(os.path.join(out_dir, "hf_parity_float32.json"), {"logits_rel_err": 1e-7, "pass": True})
        write(os.path.join(out_dir, "hf_parity_bfloat16.json"), {"logits_rel_err": 0.5, "pass": False})
        rc, out = bench("--out", out_dir, "verify", "parity")
        self.assertNotEqual(rc, 0, out)
        self.assertIn("hf_parity_bfloat16.json: pass is False", out)
        write(os.path.join(out_dir, "hf_parity_bfloat16.json"), {"logits_rel_err": 1e-3, "pass": True})
        rc, out = bench("--out", out_dir, "verify", "parity")
        self.assertEqual(rc, 0, out)

    def test_a_family_over_tolerance_fails(self):
        out_dir = folder("out_families")
        write(os.path.join(out_dir, "families.json"),
              {"families": {"qwen3": {"pass": True}, "llama": {"pass": False, "fp32_logits_rel_err": 1e-3}}})
        rc, out = bench("--out", out_dir, "verify", "families")
        self.assertNotEqual(rc, 0, out)
        self.assertIn("families.json llama: pass is False", out)

    def test_a_missing_result_fails(self):
        rc, out = bench("--out", folder("out_empty"), "verify", "step", "long")
        self.assertNotEqual(rc, 0, out)
        self.assertIn("missing result step.json", out)
        self.assertIn("missing result long_context.json", out)

    def test_a_benchmark_that_cannot_run_fails(self):
        # No dgrad_bench in this build folder: the command fails and its result is missing.
        rc, out = bench("--build-dir", folder("build_empty"), "--out", folder("out_dgrad"), "suite", "dgrad")
        self.assertNotEqual(rc, 0, out)
        self.assertIn("dgrad_bench", out)
        self.assertIn("missing result dgrad.json", out)

    def test_pack_raw_keeps_the_results_and_packs_the_rest(self):
        import tarfile
        out_dir = folder("out_pack")
        write(os.path.join(out_dir, "hf_parity_float32.json"), {"pass": True})
        write(os.path.join(out_dir, "hf_parity_bfloat16.json"), {"pass": True})
        for extra in ("parity.log", "ours_raw.json", "batch_fixed.json"):
            write(os.path.join(out_dir, extra), {"x": 1})
        rc, out = bench("--out", out_dir, "--pack-raw", "verify", "parity")
        self.assertEqual(rc, 0, out)
        self.assertEqual(sorted(os.listdir(out_dir)), ["hf_parity_bfloat16.json", "hf_parity_float32.json", "raw.tgz"])
        with tarfile.open(os.path.join(out_dir, "raw.tgz")) as tar:
            self.assertEqual(sorted(tar.getnames()), ["ours_raw.json", "parity.log"])

    def test_pack_raw_keeps_the_headline_results_within_the_file_limit(self):
        import tarfile
        out_dir = folder("out_pack_limit")
        deployments = ["process", "process_grpc", "in_process"]
        names = ([f"service_overhead_{d}.json" for d in deployments] + [f"service_split_{d}.json" for d in deployments]
                 + [f"service_overhead_{d}_v2.json" for d in deployments])
        for name in names + ["env.txt", "bench.log", "service_process.log"]:
            write(os.path.join(out_dir, name), {"x": 1})
        rc, out = bench("--deployment", *deployments, "--out", out_dir, "--pack-raw", "--service-log",
                        "verify", "service")
        self.assertEqual(rc, 0, out)
        kept = ["env.txt"] + names[:6] + ["raw.tgz"]
        self.assertEqual(sorted(os.listdir(out_dir)), sorted(kept))
        with tarfile.open(os.path.join(out_dir, "raw.tgz")) as tar:
            self.assertEqual(sorted(tar.getnames()), sorted(names[6:] + ["bench.log", "service_process.log"]))
        self.assertIn("results over --keep-files 8 packed too", out)

    def test_unknown_suites_are_refused_by_name(self):
        rc, out = bench("--out", folder("out_unknown"), "suite", "stepp")
        self.assertEqual(rc, 2, out)
        self.assertIn("unknown suite(s) stepp", out)

    def test_step_family_results_record_the_composed_paths_row_beside_the_default(self):
        results = os.path.join(os.path.dirname(os.path.dirname(TOOL)), "bench", "step_family_results.py")
        raw, model = folder("family_raw"), folder("family_model")
        write(os.path.join(model, "config.json"), {"num_hidden_layers": 4, "model_type": "gpt_oss"})
        with open(os.path.join(raw, "env.txt"), "w") as f:
            f.write("H100\nabc123\ntorch 2.11\n")
        write(os.path.join(raw, "batch_g.json"), {"sequences": [{"tokens": [1] * 512}] * 64})
        write(os.path.join(raw, "g_hf_lora.json"), {"step_s": 1.2, "tokens_per_s": 27306.7, "peak_memory_gib": 30})
        write(os.path.join(raw, "g_ours_lora.json"), {"date": "2026-12-06", "worker_step_median_s": 0.6})

        def run():
            out = subprocess.run([sys.executable, results, raw, model, "tiny-gpt-oss", "g"], capture_output=True,
                                 text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
            with open(os.path.join(raw, "step_g.json")) as f:
                return json.load(f)
        self.assertNotIn("g_lora_step_s_ours_composed_paths", run())
        write(os.path.join(raw, "g_ours_lora_composed_paths.json"), {"worker_step_median_s": 0.8, "peak_cuda_gib": 20})
        got = run()
        self.assertAlmostEqual(got["g_lora_tokens_per_s_over_peft"], 2.0)
        self.assertAlmostEqual(got["g_lora_step_s_ours_composed_paths"], 0.8)
        self.assertAlmostEqual(got["g_lora_tokens_per_s_over_peft_composed_paths"], 1.5)
        self.assertEqual(got["g_lora_peak_gib_ours_composed_paths"], 20)

    def test_step_family_results_count_the_gated_delta_mixer_as_the_step_ran_it(self):
        results = os.path.join(os.path.dirname(os.path.dirname(TOOL)), "bench", "step_family_results.py")
        raw, model = folder("family_gdn_raw"), folder("family_gdn_model")
        write(os.path.join(model, "config.json"), {"num_hidden_layers": 4, "model_type": "qwen3_5_text",
                                                   "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
        with open(os.path.join(raw, "env.txt"), "w") as f:
            f.write("H100\nabc123\ntorch 2.11\n")
        write(os.path.join(raw, "batch_q.json"), {"sequences": [{"tokens": [1] * 512}] * 16})
        write(os.path.join(raw, "q_hf_lora.json"), {"step_s": 2.0, "tokens_per_s": 4096.0, "peak_memory_gib": 30})
        write(os.path.join(raw, "q_gdn.json"), {"mixer_without_projections_ms": 10.0, "rule_ms": 6.0})
        write(os.path.join(raw, "q_gdn_keep_rule.json"), {"mixer_without_projections_ms": 8.0, "rule_ms": 6.0})

        def share(metrics):
            write(os.path.join(raw, "q_ours_lora.json"), {"date": "2026-12-06", "worker_step_median_s": 1.0,
                                                          "last_step_metrics": metrics})
            out = subprocess.run([sys.executable, results, raw, model, "tiny-qwen3.5", "q", "--micro_batch", "2048"],
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
            with open(os.path.join(raw, "step_q.json")) as f:
                return json.load(f)["q_gated_delta_share_of_step"]
        # 4 micro-batches x 3 linear layers: rule run again in 1 of them, kept in 3.
        self.assertAlmostEqual(share({"micro_batches:sum": 4, "micro_batches_rule_recomputed:sum": 1}),
                               (10.0 + 3 * 8.0) * 3 / 1000)
        # Without the step's metrics every micro-batch counts as recomputing the rule.
        self.assertAlmostEqual(share({}), 4 * 10.0 * 3 / 1000)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
