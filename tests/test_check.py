"""`gpudctl check` (issue 17): against the simulated node and against the fake NVML with injected faults (a lost
GPU, a reading that differs from nvidia-smi's, a CPU fallback), each producing a failing row with a clear reason."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpud.executor.onnxruntime_backend import CPU_EP, CUDA_EP
from gpud.cli.check.command import check_main
from gpud.cli.check.devices import Tolerances, compare_devices, observe, observed_from_metrics
from gpud.cli.check.report import Row, Status
from gpud.cli.check.serving import (ServingOptions, footprint_row, outputs_row, overlap_row, provider_row,
                                    throughput_row)
from gpud.cli.check.smi import SmiError, parse_list, parse_query, query, subprocess_runner
from gpud.telemetry.device_metrics import DeviceCollector
from gpud.telemetry.nvml import NvmlBackend
from tests.fake_nvidia_smi import runner, write_executable
from tests.fake_nvml import FakeNvml, dgx_a100_2gpu_mig, hgx_h100_mig

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
FAST = ["--seconds", "0.1", "--batch-sizes", "1,8", "--min-served-ratio", "0"]


def run(argv, **inject) -> tuple[int, dict]:
    out = io.StringIO()
    code = check_main([*argv, "--json"], out=out, **inject)
    return code, json.loads(out.getvalue())


def rows(report: dict, status: str | None = None, **match) -> list[dict]:
    return [r for r in report["rows"] if (status is None or r["status"] == status)
            and all(r[k] == v for k, v in match.items())]


def stub_raw(device, model_dir, batch_sizes, seconds):
    """Raw onnxruntime's figures without a second process (the fault tests are not about throughput)."""
    return {"provider": CPU_EP, "rows_per_s": {str(b): 1000.0 * b for b in batch_sizes}}


# --- nvidia-smi's output ------------------------------------------------------------------------------------------
class TestSmiParsing:
    QUERY = ("0, NVIDIA H100 80GB HBM3, GPU-11111111-2222-3333-4444-555555555555, 00000000:19:00.0, 81559, 0, "
             "71.23, 700.00, 0, 31, 345, 2619, Disabled\n"
             "1, NVIDIA H100 80GB HBM3, GPU-66666666-2222-3333-4444-555555555555, 00000000:3B:00.0, 81559, 13, "
             "[N/A], 700.00, [N/A], 33, 1980, 2619, Enabled\n")
    LIST = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-11111111-2222-3333-4444-555555555555)\n"
            "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-66666666-2222-3333-4444-555555555555)\n"
            "  MIG 3g.40gb     Device  0: (UUID: MIG-aaaaaaaa-1111-5555-9999-000000000000)\n"
            "  MIG 1c.3g.40gb  Device  1: (UUID: MIG-bbbbbbbb-1111-5555-9999-000000000000)\n")

    def test_query_rows_with_na(self):
        gpus = parse_query(self.QUERY)
        assert [g.index for g in gpus] == [0, 1]
        assert (gpus[0].memory_total_mib, gpus[0].power_draw_w, gpus[0].sm_clock_mhz) == (81559, 71.23, 345.0)
        assert (gpus[1].power_draw_w, gpus[1].utilization_percent, gpus[1].mig_enabled) == (None, None, True)
        assert gpus[0].mig_enabled is False

    def test_mig_devices_from_the_listing(self):
        migs = parse_list(self.LIST)
        assert [(m.gpu_index, m.profile) for m in migs] == [(1, "3g.40gb"), (1, "1c.3g.40gb")]

    def test_query_joins_them(self):
        answers = {"-L": self.LIST}
        gpus = query(lambda args: answers.get(args[0], self.QUERY))
        assert [len(g.mig_devices) for g in gpus] == [0, 2]

    def test_an_answer_of_the_wrong_shape_is_an_error(self):
        with pytest.raises(SmiError, match="13 were asked"):
            parse_query("0, NVIDIA A100\n")

    def test_missing_and_failing_executables(self, tmp_path):
        with pytest.raises(SmiError, match="not found"):
            subprocess_runner(str(tmp_path / "no-such-smi"))(["-L"])
        failing = tmp_path / "smi"
        failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate' >&2\nexit 9\n")
        failing.chmod(0o755)
        with pytest.raises(SmiError, match="exited 9: NVIDIA-SMI has failed"):
            subprocess_runner(str(failing))(["-L"])


# --- readings against nvidia-smi (pure) -----------------------------------------------------------------------------
class TestCompare:
    def compare(self, fake: FakeNvml, overrides=None, tol: Tolerances = Tolerances()) -> list[Row]:
        backend = NvmlBackend(nvml=fake)
        return compare_devices(observe(backend), query(runner(fake, overrides)), tol)

    def test_a_consistent_machine_passes(self):
        result = self.compare(dgx_a100_2gpu_mig())
        assert not [r for r in result if r.status is Status.FAIL]
        assert {r.item for r in result} >= {"memory.used", "power.draw", "clocks.sm", "mig.devices"}

    @pytest.mark.parametrize("watts, ok", [
        ("129.50", True),  # 123.456 W is 4.7 % under it
        ("130.20", False),  # 5.2 % over
    ])
    def test_power_within_five_percent(self, watts, ok):
        result = self.compare(dgx_a100_2gpu_mig(), {(0, "power.draw"): watts})
        row = next(r for r in result if r.device == "gpu0" and r.item == "power.draw")
        assert (row.status is Status.PASS) is ok, row

    def test_memory_is_exact(self):
        result = self.compare(dgx_a100_2gpu_mig(), {(0, "memory.used"): "1025"})  # 1 MiB more than gpud's
        row = next(r for r in result if r.device == "gpu0" and r.item == "memory.used")
        assert row.status is Status.FAIL and row.reason == "differs from nvidia-smi by more than 1 MiB (exact)"
        assert (row.gpud, row.reference) == ("1024 MiB", "1025 MiB")

    def test_reserved_memory_is_not_used_memory(self):
        """The driver's reserved memory is in NVML v1's `used` but not in nvidia-smi's: gpud reads v2."""
        fake = dgx_a100_2gpu_mig()
        fake.gpus[0].memory_reserved_bytes = 527 * MIB
        row = next(r for r in self.compare(fake) if r.device == "gpu0" and r.item == "memory.used")
        assert row.status is Status.PASS

    def test_a_gpu_gpud_does_not_list(self):
        fake = dgx_a100_2gpu_mig()
        smi = query(runner(fake))
        observed = [o for o in observe(NvmlBackend(nvml=fake)) if o.info.id != "gpu0"]
        row = next(r for r in compare_devices(observed, smi) if r.item == "present")
        assert (row.device, row.status, row.reason) == ("gpu0", Status.FAIL, "nvidia-smi lists this GPU; gpud does not")

    def test_mig_devices_differ(self):
        fake = hgx_h100_mig(gpus=1)
        smi = query(runner(fake))
        observed = [o for o in observe(NvmlBackend(nvml=fake)) if o.info.id != "gpu0/mig2.0"]
        row = next(r for r in compare_devices(observed, smi) if r.item == "mig.devices")
        assert row.status is Status.FAIL and "2g.20gb MIG-" in row.reason

    def test_a_metrics_scrape_compares_the_same_way(self):
        fake = dgx_a100_2gpu_mig()
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=fake), registry=registry)
        observed = observed_from_metrics(generate_latest(registry).decode())
        result = compare_devices(observed, query(runner(fake)))
        assert not [r for r in result if r.status is Status.FAIL], [r for r in result if r.status is Status.FAIL]
        assert any(r.item == "power.draw" and r.status is Status.PASS for r in result)


# --- rows of the serving path (pure) --------------------------------------------------------------------------------
class TestServingRows:
    def test_silent_cpu_fallback_on_a_gpu_fails_and_says_why(self):
        row = provider_row("gpu0", True, CPU_EP, (CPU_EP,))
        assert row.status is Status.FAIL and "silent CPU fallback" in row.reason and "gpu extra" in row.reason
        row = provider_row("gpu0", True, CPU_EP, (CUDA_EP, CPU_EP))
        assert row.status is Status.FAIL and "CUDA or cuDNN libraries did not load" in row.reason
        assert provider_row("gpu0", True, CUDA_EP, (CUDA_EP, CPU_EP)).status is Status.PASS
        assert provider_row("cpu", False, CPU_EP, (CPU_EP,)).status is Status.PASS

    def test_footprint_against_nvml(self):
        opts = ServingOptions()
        assert footprint_row("gpu0", 200 * MIB, 210 * MIB, opts).status is Status.PASS  # 10 MiB < max(16, 21)
        row = footprint_row("gpu0", 100 * MIB, 300 * MIB, opts)
        assert row.status is Status.FAIL and "placement would count wrong" in row.reason

    def test_outputs_within_tolerance_of_their_magnitude(self):
        import numpy as np

        want = {"output": np.array([[100.0, -3.0]], dtype=np.float32)}
        assert outputs_row("gpu0", 1, {"output": want["output"] + 0.005}, want, 1e-4).status is Status.PASS
        # 0.005 / 100 = 5e-5 of the output's magnitude; 0.02 / 100 = 2e-4 is over
        assert outputs_row("gpu0", 1, {"output": want["output"] + 0.02}, want, 1e-4).status is Status.FAIL
        assert outputs_row("gpu0", 1, {}, want, 1e-4).status is Status.FAIL

    def test_throughput_strict_on_a_gpu_lenient_on_the_cpu(self):
        served, raw = {1: 500.0, 8: 3000.0}, {1: 800.0, 8: 4000.0}  # best 3000 / best 4000 = 0.75
        assert throughput_row("gpu0", served, raw, CUDA_EP, 0.9, strict=True).status is Status.FAIL
        assert throughput_row("cpu", served, raw, CPU_EP, 0.9, strict=False).status is Status.WARN
        assert throughput_row("gpu0", served, raw, CUDA_EP, 0.7, strict=True).status is Status.PASS

    def test_overlap(self):
        assert overlap_row("gpu0", 1000.0, 1500.0, 1.05).status is Status.PASS
        row = overlap_row("gpu0", 1000.0, 1010.0, 1.05)
        assert row.status is Status.FAIL and "do not overlap" in row.reason


# --- the command --------------------------------------------------------------------------------------------------------
class TestFakeNvmlNode:
    def test_consistent_node_passes(self):
        fake = dgx_a100_2gpu_mig()
        code, report = run(["--skip-serving"], nvml=fake, smi=runner(fake))
        assert code == 0 and report["ok"] and report["counts"]["fail"] == 0
        assert rows(report, "pass", item="devices")[0]["reason"] == "driver 550.127.05"

    def test_lost_gpu_fails_with_the_reason(self):
        fake = dgx_a100_2gpu_mig()
        fake.lose_gpu(1)
        code, report = run(["--skip-serving"], nvml=fake, smi=runner(fake))
        assert code == 1
        (lost,) = rows(report, "fail")  # lost before gpud enumerated it: its MIG devices cannot be listed
        assert (lost["device"], lost["item"], lost["gpud"]) == ("gpu1", "health", "lost")
        assert "NVML_ERROR_GPU_IS_LOST" in lost["reason"]
        assert rows(report, "pass", device="gpu0", item="memory.used")  # the other GPU is still checked

    def test_reading_that_differs_from_nvidia_smi_fails(self):
        fake = dgx_a100_2gpu_mig()
        code, report = run(["--skip-serving"], nvml=fake, smi=runner(fake, {(0, "temperature.gpu"): "47"}))
        assert code == 1
        (row,) = rows(report, "fail")
        assert (row["device"], row["item"], row["gpud"], row["reference"]) == ("gpu0", "temperature.gpu", "41 C",
                                                                              "47 C")
        assert row["reason"] == "differs from nvidia-smi by more than 2 C"

    def test_nvidia_smi_as_an_executable(self, tmp_path):
        fake = dgx_a100_2gpu_mig()
        smi = write_executable(tmp_path / "nvidia-smi", fake, {(1, "power.draw"): "120.00"})
        code, report = run(["--skip-serving", "--nvidia-smi", str(smi)], nvml=fake)
        assert code == 1
        assert [(r["device"], r["item"]) for r in rows(report, "fail")] == [("gpu1", "power.draw")]

    def test_no_nvidia_smi_is_a_warning(self, tmp_path):
        fake = dgx_a100_2gpu_mig()
        code, report = run(["--skip-serving", "--nvidia-smi", str(tmp_path / "absent")], nvml=fake)
        assert code == 0
        assert "readings not compared" in rows(report, "warn", item="nvidia-smi")[0]["reason"]

    @pytest.mark.slow
    def test_cpu_fallback_on_a_gpu_fails(self):
        """The fake NVML reports a real GPU; the worker's onnxruntime (CPU-only here) runs the model on the CPU:
        exactly what a node without onnxruntime-gpu does, silently, unless someone checks."""
        fake = dgx_a100_2gpu_mig()
        code, report = run(["--devices", "gpu0", *FAST], nvml=fake, smi=runner(fake), raw=stub_raw)
        assert code == 1
        (row,) = rows(report, "fail", device="gpu0", item="provider")
        assert row["gpud"] == CPU_EP and "silent CPU fallback on a GPU" in row["reason"]
        assert rows(report, "pass", device="gpu0", item="outputs b=8")  # it computed, just not on the GPU


class TestSimulatedNode:
    def test_no_driver_says_so_and_checks_the_simulated_node(self):
        code, report = run(["--skip-serving"], nvml=FakeNvml(driver="missing"))
        assert code == 0
        (row,) = rows(report, "warn", item="devices")
        assert row["reason"].startswith("no NVIDIA GPU usable (the NVML library (libnvidia-ml.so.1) was not found")
        assert "simulated node" in row["reason"]
        code, report = run(["--skip-serving", "--expect-gpu"], nvml=FakeNvml(driver="missing"))
        assert code == 1 and rows(report, "fail", item="devices")

    @pytest.mark.slow
    def test_serving_path_on_a_simulated_node(self):
        node = str(ROOT / "config" / "nodes" / "a100-40gb-1gpu.yaml")  # one A100 40GB in MIG mode
        code, report = run(["--node", node, "--devices", "gpu0/mig1.0", *FAST])
        assert code == 0, [r for r in report["rows"] if r["status"] == "fail"]
        for item in ("load", "provider", "outputs b=1", "outputs b=8", "throughput"):
            assert rows(report, "pass", device="gpu0/mig1.0", item=item), item
        assert rows(report, "skip", device="gpu0/mig1.0", item="overlap")
        assert not rows(report, section="serving", device="cpu")  # only the devices asked for
        throughput = rows(report, device="gpu0/mig1.0", item="throughput")[0]
        assert "rows/s" in throughput["gpud"] and "raw on CPUExecutionProvider" in throughput["reason"]

    def test_bad_input_changes_nothing_and_says_why(self, capsys):
        node = str(ROOT / "config" / "nodes" / "a100-40gb-1gpu.yaml")
        assert check_main(["--node", node, "--devices", "gpu7"]) == 2
        assert "no leaf device gpu7 here (leaf devices: gpu0/mig1.0, gpu0/mig2.0, gpu0/mig3.0, cpu)" in capsys.readouterr().err
        with pytest.raises(SystemExit) as exc:
            check_main(["--batch-sizes", "0,8"])
        assert exc.value.code == 2
        assert check_main(["--node", str(ROOT / "no-such-node.yaml")]) == 2


@pytest.mark.slow
def test_against_a_running_daemon(tmp_path):
    from gpud.examples import write_example_repository
    from tests.daemon_harness import start_daemon

    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    daemon = start_daemon(repo, tmp_path)
    try:
        code, report = run(["--url", daemon.http_url])
        assert code == 0, report
        assert rows(report, "pass", item="reachable")
        assert rows(report, "pass", section="daemon", item="mlp:1#0 provider")
        assert rows(report, "skip", item="nvidia-smi")[0]["reason"] == "the daemon runs on a simulated node"
    finally:
        assert daemon.stop() == 0, daemon.log()
    code, report = run(["--url", daemon.http_url])  # gone now
    assert code == 1 and "cannot reach gpud" in rows(report, "fail", item="reachable")[0]["reason"]


# --- progress on a terminal (issue 24, item 6) ----------------------------------------------------------------------
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class TestProgress:
    """Each step is said on stderr as it starts and ends when stdout is a terminal; nothing with --json or when
    stdout is a pipe or a file (the report is all the output)."""

    def test_quiet_with_json_and_when_stdout_is_not_a_terminal(self, capsys):
        node = str(ROOT / "config" / "nodes" / "a100-40gb-1gpu.yaml")
        for argv, out in ((["--node", node, "--skip-serving", "--json"], Terminal()),
                          (["--node", node, "--skip-serving"], io.StringIO())):
            assert check_main(argv, out=out) == 0
            assert capsys.readouterr().err == "", argv
            assert out.getvalue().startswith("{" if "--json" in argv else "gpudctl check: ")

    @pytest.mark.slow
    def test_each_step_is_said_on_a_terminal_as_it_starts_and_ends(self, capsys):
        node = str(ROOT / "config" / "nodes" / "a100-40gb-1gpu.yaml")
        seen_at_raw: list[str] = []

        def raw(device, model_dir, batch_sizes, seconds):  # runs within the throughput part: said already?
            seen_at_raw.append(capsys.readouterr().err)
            return stub_raw(device, model_dir, batch_sizes, seconds)

        out = Terminal()
        assert check_main(["--node", node, "--devices", "gpu0/mig1.0", *FAST], out=out, raw=raw) == 0
        err = "".join(seen_at_raw) + capsys.readouterr().err
        assert seen_at_raw and seen_at_raw[0].endswith(
            "gpudctl check: serving path on gpu0/mig1.0: worker, load, outputs, throughput"), seen_at_raw
        lines = err.splitlines()
        assert lines[0].startswith("gpudctl check: device readings (simulated:") and " ... pass (" in lines[0]
        assert re.fullmatch(r"gpudctl check: serving path on gpu0/mig1\.0: worker, load, outputs, throughput "
                            r"\.\.\. (pass|\d+ warnings?) \(\d+\.\d s\)", lines[-1]), lines  # a busy CPU may warn
        assert out.getvalue().startswith("gpudctl check: ") and "gpudctl check: serving" not in out.getvalue()
