"""Targets: profiles, the runner protocol, ssh against a real sshd, arm64 under qemu, rooflines."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import missing_prerequisite, one_line_error
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.errors import ConfigError, RuntimeNotInstalledError
from slmedge.evaluate.api import EvalSettings, evaluate
from slmedge.evaluate.store import ResultsStore
from slmedge.evaluate.subject import open_subject
from slmedge.targets.profiles import Profile, TargetError, all_profiles, get_profile, parse_profile
from slmedge.targets.roofline import roofline, set_against
from slmedge.targets.transports import LocalChild

runner = CliRunner()
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 12


@pytest.fixture
def task_file(tmp_path):
    f = tmp_path / "mini.jsonl"
    rows = [{"query": "The sky is", "choices": ["blue", "green grass", "a"], "gold": 0},
            {"query": "Two and two make", "choices": ["four", "seven", "many fish"], "gold": 0}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return f


def _settings(tmp_path, task_file, **kw):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    base = dict(metrics=("perplexity", "tasks", "memory", "latency"), langs=(), wikitext=False,
                corpora=(str(corpus),), seqlen=32, ppl_windows=2, tasks=(str(task_file),), pp=16, tg=4, repeats=1,
                context=64, threads=1)
    base.update(kw)
    return EvalSettings(**base)


# --- profiles ---------------------------------------------------------------------------------


def test_shipped_profiles_parse_and_list(monkeypatch):
    profiles = all_profiles()
    for name in ("cpu", "arm64", "cuda", "raspberry-pi-5", "snapdragon-8-gen-3", "jetson-orin-nano"):
        assert name in profiles, name
    pi = profiles["raspberry-pi-5"]
    assert pi.arch == "aarch64" and pi.memory_bandwidth_gbs > 0 and pi.peak_fp32_gflops > 0 and pi.ssh is not None
    assert profiles["arm64"].emulated and profiles["arm64"].threads <= 4
    cpu = get_profile("cpu")  # detected: this machine, bandwidth and compute measured once
    assert cpu.cores == os.cpu_count() and cpu.memory_bandwidth_gbs > 0 and cpu.peak_fp32_gflops > 0
    res = runner.invoke(app, ["targets", "list"])
    assert res.exit_code == 0 and "raspberry-pi-5" in res.output and "arm64" in res.output
    res = runner.invoke(app, ["targets", "show", "cpu", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["memory_bandwidth_gbs"] > 0


def test_user_profiles_and_strict_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path))
    (tmp_path / "mine.toml").write_text('transport = "local"\ncores = 2\nram_gb = 4\n')
    assert get_profile("mine").ram_gb == 4
    bad = tmp_path / "bad.toml"
    for text, words in (('transport = "local"\ncolour = "red"\n', ["unknown key 'colour'", "bad.toml"]),
                        ('transport = "carrier-pigeon"\n', ["carrier-pigeon"]),
                        ('transport = "local"\ncores = "four"\n', ["'cores' must be a int"]),
                        ('transport = "ssh"\n[ssh]\nhost = "h"\nportt = 2\n', ["unknown key 'portt'"])):
        bad.write_text(text)
        with pytest.raises(ConfigError) as err:
            parse_profile(bad)
        for w in words:
            assert w in str(err.value)
    bad.unlink()
    with pytest.raises(ConfigError, match="unknown target 'nope'"):
        get_profile("nope")


def test_unknown_target_is_one_clear_error(exports, tmp_path):
    res = runner.invoke(app, ["evaluate", (exports["llama.cpp"]), "--target", "atlantis", "--metrics", "memory"])
    one_line_error(res, "unknown target 'atlantis'", "cpu")


def test_a_runtime_the_gpu_target_does_not_list_is_refused(exports, tmp_path):
    """The cuda transport (a GPU in this process) refuses, before anything opens, a file whose runtime
    its profile does not list (ExecuTorch's bindings and onnxruntime-genai run on the CPU here), instead
    of running it on this machine's CPU under the GPU's name; no GPU is needed to say so. A CPU target
    runs any runtime installed."""
    prof = tmp_path / "gpu-like.toml"
    prof.write_text('name = "gpu-like"\ntransport = "cuda"\ndetect = false\nthreads = 1\n'
                    'runtimes = ["torch", "llama.cpp"]\n')
    res = runner.invoke(app, ["evaluate", exports["onnxruntime"], "--target", str(prof), "--metrics", "memory",
                              "--results-db", str(tmp_path / "db")])
    one_line_error(res, "target 'gpu-like' offers torch, llama.cpp, not onnxruntime", "--target cpu")
    cpu = tmp_path / "cpu-like.toml"
    cpu.write_text(prof.read_text().replace('"cuda"', '"local"').replace("gpu-like", "cpu-like"))
    res = runner.invoke(app, ["evaluate", exports["onnxruntime"], "--target", str(cpu), "--metrics", "memory",
                              "--results-db", str(tmp_path / "db")])
    assert res.exit_code == 0, res.output


def test_roofline_bounds_and_fractions():
    prof = Profile(name="t", transport="local", memory_bandwidth_gbs=10.0, peak_fp32_gflops=100.0,
                   peak_int8_gops=400.0)
    b = roofline(prof, weight_bytes=100_000_000, kv_bytes_per_token=1000, params=50_000_000, context_tokens=1000,
                 integer_kernels=True)
    assert b["decode_bytes_per_token"] == 101_000_000
    assert abs(b["decode_bound_tps"] - 10e9 / 101e6) < 1e-9
    assert abs(b["prefill_bound_tps"] - 400e9 / 100e6) < 1e-9 and b["prefill_peak"].startswith("int8")
    got = set_against(b, decode_tps=49.5, prefill_tps=1000.0, measured=True)
    assert abs(got["decode_fraction"] - 49.5 / (10e9 / 101e6)) < 1e-12 and abs(got["prefill_fraction"] - 0.25) < 1e-12
    proj = set_against(b, decode_tps=49.5, prefill_tps=None, measured=False)
    assert "projection" in proj["label"] and "decode_fraction" not in proj


def test_projection_for_a_profile_without_a_device(exports):
    res = runner.invoke(app, ["targets", "show", "raspberry-pi-5", "--model", (exports["llama.cpp"]), "--json"])
    assert res.exit_code == 0, res.output
    p = json.loads(res.output[res.output.index("{"):])["projection"]  # (CliRunner mixes stderr in)
    size = Path(exports["llama.cpp"]).stat().st_size
    assert "projection" in p["label"] and p["decode_bound_tps"] < 17.1e9 / size


def test_cpu_latency_is_set_against_this_machines_roofline(exports, tmp_path, task_file):
    res = evaluate((exports["llama.cpp"]), _settings(tmp_path, task_file, metrics=("latency",)))
    roof = res["metrics"]["latency"]["roofline"]
    assert roof["label"] == "measured vs roofline" and roof["target"] == "cpu"
    assert roof["decode_fraction"] == pytest.approx(res["metrics"]["latency"]["decode_tps"]["median"]
                                                    / roof["decode_bound_tps"])


# --- the runner (a child process: the protocol every remote transport speaks) --------------------


@pytest.mark.parametrize("runtime", ["llama.cpp", "onnxruntime"])
def test_runner_in_a_child_process_scores_like_in_process(runtime, exports):
    prof = Profile(name="child", transport="local", threads=1, runtimes=["llama.cpp", "onnxruntime"])
    local = open_subject((exports[runtime]), threads=1)
    remote = open_subject((exports[runtime]), threads=1, factory=LocalChild(prof).open_runtime)
    try:
        ids = local.encoder.encode(TEXT)[:40]
        assert np.array_equal(local.runtime.logits(ids), remote.runtime.logits(ids))
        groups = [(ids[:10], [ids[10:14], ids[20:21]]), (ids[:3], [ids[3:9]])]
        for ga, gb in zip(local.runtime.score_groups(groups), remote.runtime.score_groups(groups)):
            for (a, x), (b, y) in zip(ga, gb):
                assert np.array_equal(a, b) and x == y
        t = remote.runtime.timed_generate(ids[:8], 3)
        assert t.prompt_tokens == 8 and t.decode_tps > 0
    finally:
        local.close()
        remote.close()


def test_runner_reports_a_missing_runtime(exports, tmp_path):
    env = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env)], check=True)
    # A Python that sees numpy but neither runtime: block both imports in its site-packages.
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "llama_cpp.py").write_text("raise ImportError('not here')\n")
    (site / "onnxruntime.py").write_text("raise ImportError('not here')\n")

    class Bare(LocalChild):
        def runner_argv(self, args):
            return [str(env / "bin" / "python"), *super().runner_argv(args)[1:]]

    prof = Profile(name="bare", transport="local", runtimes=["llama.cpp", "onnxruntime"])
    with pytest.raises(RuntimeNotInstalledError, match="target 'bare' has no llama.cpp: pip install llama-cpp-python"):
        open_subject((exports["llama.cpp"]), factory=Bare(prof).open_runtime)


# --- ssh: a real sshd on 127.0.0.1 -----------------------------------------------------------------

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").is_file() else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if SSHD is None:
        missing_prerequisite("sshd is not installed (apt-get install openssh-server; scripts/setup.sh installs it)")
    d = tmp_path_factory.mktemp("sshd")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "user_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "other_key")], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    port = _free_port()
    (d / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {d / 'host_key'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile {d / 'authorized_keys'}
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
Subsystem sftp internal-sftp
LogLevel ERROR
""")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail(f"sshd did not start: {proc.stderr.read().decode()[-500:]}")
    host_pub = (d / "host_key.pub").read_text().split()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    (d / "empty_known_hosts").write_text("")
    yield {"dir": d, "port": port}
    proc.terminate()
    proc.wait(timeout=10)


def _ssh_profile(folder: Path, sshd, name="ssh-localhost", key="user_key", known="known_hosts", port=None,
                 host="127.0.0.1", ram_gb=None, timeout=10):
    import getpass

    folder.mkdir(parents=True, exist_ok=True)
    work = folder / "remote-work"
    text = f'''name = "{name}"
transport = "ssh"
arch = "x86_64"
cores = 2
threads = 1
{f"ram_gb = {ram_gb}" if ram_gb else ""}
runtimes = ["llama.cpp", "onnxruntime"]

[ssh]
host = "{host}"
user = "{getpass.getuser()}"
port = {port or sshd["port"]}
key = "{sshd["dir"] / key}"
known_hosts = "{sshd["dir"] / known}"
python = "{sys.executable}"
workdir = "{work}"
connect_timeout_s = {timeout}
'''
    (folder / f"{name}.toml").write_text(text)
    return work


@pytest.mark.parametrize("runtime", ["llama.cpp", "onnxruntime"])
def test_ssh_target_gives_the_same_numbers_as_local(runtime, sshd, exports, tmp_path, task_file, monkeypatch):
    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path / "profiles"))
    work = _ssh_profile(tmp_path / "profiles", sshd)
    res = runner.invoke(app, ["targets", "check", "ssh-localhost"])
    assert res.exit_code == 0, res.output
    store = ResultsStore(tmp_path / "r.sqlite")
    local = evaluate((exports[runtime]), _settings(tmp_path, task_file))
    remote = evaluate((exports[runtime]), _settings(tmp_path, task_file, target="ssh-localhost"), store=store)
    lp, rp = local["metrics"]["perplexity"]["c.txt"], remote["metrics"]["perplexity"]["c.txt"]
    assert rp["tokens"] == lp["tokens"] and rp["perplexity"] == pytest.approx(lp["perplexity"], rel=1e-6)
    (lt,), (rt,) = local["metrics"]["tasks"].values(), remote["metrics"]["tasks"].values()
    assert (rt["acc"], rt.get("acc_norm")) == (lt["acc"], lt.get("acc_norm"))
    assert remote["metrics"]["memory"]["peak_rss_bytes"] > 0 and remote["metrics"]["latency"]["decode_tps"]["median"] > 0
    assert remote["target"] == "ssh-localhost" and remote["emulated"] is False
    assert any(work.rglob("*.gguf" if runtime == "llama.cpp" else "*.onnx"))  # copied to the "device"
    rows = store.rows(remote["run_id"])
    assert rows and {r["target"] for r in rows} == {"ssh-localhost"}
    store.close()


def test_ssh_errors_are_clear(sshd, exports, tmp_path, monkeypatch, task_file):
    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path / "p"))
    gguf = (exports["llama.cpp"])
    # failed authentication (a key the server does not know)
    _ssh_profile(tmp_path / "p", sshd, name="wrong-key", key="other_key")
    with pytest.raises(TargetError, match="authentication failed"):
        evaluate(gguf, _settings(tmp_path, task_file, target="wrong-key", metrics=("memory",)))
    # an unknown host key is refused, not accepted
    _ssh_profile(tmp_path / "p", sshd, name="unknown-host", known="empty_known_hosts")
    with pytest.raises(TargetError, match="host key verification failed"):
        evaluate(gguf, _settings(tmp_path, task_file, target="unknown-host", metrics=("memory",)))
    # a dead host: nothing listens there; the error comes within the connect timeout
    _ssh_profile(tmp_path / "p", sshd, name="dead", port=_free_port(), timeout=3)
    t = time.time()
    res = runner.invoke(app, ["evaluate", gguf, "--target", "dead", "--metrics", "memory"])
    one_line_error(res, "unreachable")
    assert time.time() - t < 30
    # a model larger than the target's RAM: refused with the numbers, before anything is copied (the
    # estimate of what the run allocates against the target's memory, slmedge.limits.check_memory)
    work = _ssh_profile(tmp_path / "p", sshd, name="tiny-ram", ram_gb=0.0001)
    res = runner.invoke(app, ["evaluate", gguf, "--target", "tiny-ram", "--metrics", "memory"])
    one_line_error(res, "tiny-ram", "needs about", "0.10 MB available")
    assert not any(work.rglob("*.gguf"))


def test_ssh_profile_fields_never_reach_a_shell(tmp_path, monkeypatch):
    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path))
    (tmp_path / "evil.toml").write_text('transport = "ssh"\n[ssh]\nhost = "h"\nworkdir = "x; rm -rf ~"\n')
    from slmedge.targets.transports import transport_for

    with pytest.raises(ConfigError, match="does not pass to a remote command"):
        transport_for(get_profile("evil"))
    (tmp_path / "nohost.toml").write_text('transport = "ssh"\n[ssh]\nuser = "pi"\n')
    with pytest.raises(ConfigError, match="no \\[ssh\\] host"):
        transport_for(get_profile("nohost"))


# --- arm64 under qemu ------------------------------------------------------------------------------




@pytest.mark.parametrize("runtime", ["llama.cpp", "onnxruntime"])
def test_arm64_emulated_agrees_with_native_x86(runtime, arm64_env, exports, tmp_path, task_file):
    if not (arm64_env.get("versions") or {}).get(runtime):
        missing_prerequisite(f"the arm64 environment has no {runtime}")
    store = ResultsStore(tmp_path / "r.sqlite")
    settings = dict(metrics=("perplexity", "tasks", "latency"), ppl_windows=1, pp=8, tg=2)
    native = evaluate((exports[runtime]), _settings(tmp_path, task_file, **settings))
    arm = evaluate((exports[runtime]), _settings(tmp_path, task_file, target="arm64", **settings), store=store)
    assert arm["versions"]["target"]["machine"] == "aarch64"
    a, n = arm["metrics"]["perplexity"]["c.txt"], native["metrics"]["perplexity"]["c.txt"]
    assert a["tokens"] == n["tokens"] and a["perplexity"] == pytest.approx(n["perplexity"], rel=1e-3)
    assert [t["acc"] for t in arm["metrics"]["tasks"].values()] == [t["acc"] for t in native["metrics"]["tasks"].values()]
    lat = arm["metrics"]["latency"]
    assert lat["emulated"] is True and "projection" in lat["roofline"]["label"]
    assert "decode_fraction" not in lat["roofline"]
    rows = store.rows(arm["run_id"])
    assert rows and all(r["target"] == "arm64" and r["emulated"] == 1 for r in rows)
    store.close()


# --- arm64 setup: the record is written only after the runner passed its check (no qemu needed) ----

ARM_VERSIONS = {"python": "3.11.2", "machine": "aarch64", "system": "Linux", "numpy": "2.0.0",
                "onnxruntime": "1.20.0", "llama.cpp": "0.3.0", "onnxruntime-genai": "0.18.0"}


@pytest.fixture
def fake_setup(tmp_path, monkeypatch):
    """setup_arm64 with the downloads and builds stubbed out and an environment root under
    tmp_path; ``answer["versions"]``: what the runner says (a dict, or an exception to raise)."""
    from slmedge.targets import emulation

    monkeypatch.setenv("SLMEDGE_TARGET_ENVS", str(tmp_path / "envs"))
    monkeypatch.setattr(emulation, "_setup_qemu", lambda root, log: "/usr/bin/qemu-aarch64-static")
    monkeypatch.setattr(emulation, "_setup_sysroot", lambda root, log: None)
    monkeypatch.setattr(emulation, "_setup_wheels", lambda root, log: None)
    monkeypatch.setattr(emulation, "_setup_llama_cpp", lambda root, log: "0.3.0")
    answer = {"versions": dict(ARM_VERSIONS), "calls": 0}

    def versions(self):
        answer["calls"] += 1
        # The check runs on the record in memory: nothing is on disk yet.
        assert not (self.root / "env.json").exists(), "env.json was written before the runner passed"
        assert self.manifest()["qemu"] == "/usr/bin/qemu-aarch64-static"
        if isinstance(answer["versions"], Exception):
            raise answer["versions"]
        return answer["versions"]

    monkeypatch.setattr(emulation.EmulatedTransport, "versions", versions)
    answer["env"] = tmp_path / "envs" / "arm64" / "env.json"
    return answer


@pytest.mark.parametrize("versions,words", [
    ({**ARM_VERSIONS, "machine": "x86_64"}, "machine 'x86_64'"),
    ({**ARM_VERSIONS, "llama.cpp": None}, "no llama.cpp version"),
    ({k: v for k, v in ARM_VERSIONS.items() if k != "onnxruntime"}, "no onnxruntime version"),
    (TargetError("target 'arm64': the runner failed: Illegal instruction"), "Illegal instruction"),
])
def test_arm64_setup_with_a_failing_check_leaves_no_record(fake_setup, versions, words):
    from slmedge.targets.emulation import SetupError, setup_arm64, up_to_date

    fake_setup["versions"] = versions
    with pytest.raises(SetupError, match="failed its check under emulation") as err:
        setup_arm64(get_profile("arm64"), log=lambda msg: None)
    assert words in str(err.value) and fake_setup["calls"] == 1
    assert not fake_setup["env"].exists() and not up_to_date()


def test_arm64_setup_with_a_passing_check_writes_the_record(fake_setup):
    from slmedge.targets.emulation import setup_arm64, up_to_date

    fake_setup["versions"] = {**ARM_VERSIONS, "llama.cpp": None}  # a failed build first
    with pytest.raises(TargetError):
        setup_arm64(get_profile("arm64"), log=lambda msg: None)
    assert not up_to_date()
    fake_setup["versions"] = dict(ARM_VERSIONS)
    m = setup_arm64(get_profile("arm64"), log=lambda msg: None)
    record = json.loads(fake_setup["env"].read_text())
    assert record["versions"] == ARM_VERSIONS == m["versions"] and record["runtimes"] == ["onnxruntime", "llama.cpp", "onnxruntime-genai"]
    assert up_to_date()
    # without llama.cpp the check asks for onnxruntime only (and --if-needed still builds it all)
    fake_setup["versions"] = {**ARM_VERSIONS, "llama.cpp": None}
    m = setup_arm64(get_profile("arm64"), log=lambda msg: None, llama_cpp=False)
    assert m["runtimes"] == ["onnxruntime", "onnxruntime-genai"] and fake_setup["env"].is_file() and not up_to_date()


def test_a_record_without_a_runtime_version_is_not_up_to_date(fake_setup):
    from slmedge.targets.emulation import _wanted, up_to_date

    fake_setup["env"].parent.mkdir(parents=True)
    for versions in ({**ARM_VERSIONS, "llama.cpp": None}, {**ARM_VERSIONS, "machine": "x86_64"}, None):
        record = {"wanted": _wanted(), "built": {"llama.cpp": "0.3.0"}}  # what a failed check left before
        if versions is not None:
            record["versions"] = versions
        fake_setup["env"].write_text(json.dumps(record))
        assert not up_to_date(), versions
    fake_setup["env"].write_text(json.dumps({"wanted": _wanted(), "versions": ARM_VERSIONS}))
    assert up_to_date()


def test_setup_if_needed_rebuilds_after_a_failed_check(fake_setup):
    fake_setup["versions"] = {**ARM_VERSIONS, "machine": "x86_64"}
    res = runner.invoke(app, ["targets", "setup", "arm64", "--if-needed"])
    last = res.output.strip().splitlines()[-1]  # after the setup's progress lines: one error line
    assert res.exit_code == 1 and "Traceback" not in res.output and last.startswith("error:"), res.output
    assert "failed its check under emulation" in last and "x86_64" in last
    assert not fake_setup["env"].exists()
    fake_setup["versions"] = dict(ARM_VERSIONS)
    res = runner.invoke(app, ["targets", "setup", "arm64", "--if-needed"])
    assert res.exit_code == 0 and "ready:" in res.output and fake_setup["calls"] == 2, res.output
    res = runner.invoke(app, ["targets", "setup", "arm64", "--if-needed"])
    assert res.exit_code == 0 and "already built" in res.output and fake_setup["calls"] == 2, res.output


# --- cuda ---------------------------------------------------------------------------------------------


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def test_cuda_check_without_a_gpu_says_what_is_missing():
    if _has_cuda():
        pytest.skip("a GPU is present (test_cuda_evaluation covers it)")
    res = runner.invoke(app, ["targets", "check", "cuda"])
    assert res.exit_code == 1 and "torch CUDA" in res.output and "NO" in res.output


@pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU")
def test_cuda_evaluation_matches_cpu(exports, tmp_path, task_file):
    cpu = evaluate((exports["onnxruntime"]), _settings(tmp_path, task_file, metrics=("perplexity",)))
    gpu = evaluate((exports["onnxruntime"]), _settings(tmp_path, task_file, metrics=("perplexity",), target="cuda"))
    assert gpu["metrics"]["perplexity"]["c.txt"]["perplexity"] == pytest.approx(
        cpu["metrics"]["perplexity"]["c.txt"]["perplexity"], rel=1e-3)


@pytest.mark.parametrize("field,value", [("host", "-oProxyCommand=touch pwned"), ("user", "-l"),
                                         ("workdir", "-rf"), ("python", "--version")])
def test_ssh_values_that_would_read_as_options_are_refused(field, value, tmp_path, monkeypatch):
    from slmedge.targets.transports import transport_for

    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path))
    ssh = {"host": "h", field: value}
    (tmp_path / "dash.toml").write_text('transport = "ssh"\n[ssh]\n' + "".join(f'{k} = "{v}"\n' for k, v in ssh.items()))
    with pytest.raises(ConfigError, match="not starting with -"):
        transport_for(get_profile("dash"))
