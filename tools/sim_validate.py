#!/usr/bin/env python3
"""Simulator against reality (issue 22, item 4): the same seeded workload through `baton bench-serve` against a
local cluster and through `baton simulate` with this machine's profile, repeated, compared on medians.

Each measurement runs in its own quiet window (one per workload and repetition, a few minutes each): wait until
the quiet file (default /tmp/QUIET) is gone, create it, then `baton profile` (unless --profile), start the cluster
(deploy/local/cluster up --detach, its own ports and run directory), warm it up, probe the serving path outside
the engines (serial one-token requests: their TTFT less the profile's step for them is the profile's
router.request_s) and what streaming costs outside the engine's loop (long streams at batch 1 and 4: their TPOT
less the profile's step, split into a part per decode step, router.step_s, and per row, router.token_s; the
router's and the client's CPU per token, which on one host comes out of some node's cores: colocated the decode
node's, so at least that much per row; 1P+1D the prefill node's, router.prefill_token_s), run bench-serve (the
CPU each process took during it is recorded), stop the cluster, delete the file. The load averages at each window's start
and end are kept, and the share of the CPUs that other processes took during it (all busy time less the
measurement's own), over the window and over the measured load alone. The quiet file binds only those who honour
it, so a window also waits until other processes use less than --max-others of the CPUs, and one they disturbed
anyway (over the window or during the load) is measured again and left out of the medians (so are disturbed repetitions, when another repetition of the load was clean). The simulator then runs the same workload file (bench-serve and the simulator draw arrivals and
lengths from the seed alike: tools/workload.c wl_draw) with that window's profile.

The SLO is the run's own unless given: --slo-scale (default 2) times what one request of the first workload's
mean lengths costs this host on the idle cluster, by the first window's profile and probes (host_slo). A window
whose profile priced prefill more than --max-speed-moved off the run's median is disturbed too (the host's speed
moved while nothing visible ran), and so is one whose engine speed (a short `baton bench`, before and after the
load) moved by more than that within the window, or (1P+1D) whose decode node's decode steps that no prefill step
overlapped ran more than that off the profile's prices for them (its step trace); and so is one whose prefill
during the load ran more than --max-load-speed-moved (10%) off the profile's price (1P+1D: the prefill node's CPU
per prompt token; colocated: the decode node's steps that computed one prompt and nothing else, its step trace).

Prints one table: per load and cell (TTFT/TPOT p50 and p90, goodput = requests within both SLOs), the median
measured and median simulated value over the repetitions, the relative error and whether it meets the target
(15% for latencies, 10% for goodput). Exit status 1 when a target is missed (0 with --no-targets), 2 when a
command failed.

usage: tools/sim_validate.py [--repeats N] [--profile P.json] [--profile-reps N] [--shape colocated|1p1d]
                             [--slo-scale F | --slo-ttft-ms MS --slo-tpot-ms MS] [--port-base PORT] [--model GGUF]
                             [--quiet-file PATH | --quiet-file ''] [--lock PATH] [--json OUT] [--no-targets]
                             [WORKLOAD...]
       tools/sim_validate.py --resimulate OUT.json   (simulate the recorded windows again, measure nothing)
Without workloads: tools/workloads/validate-{low,mid,high}.json. It needs a machine that nothing else loads
while it measures; it is not part of `make test` (tests/integration/test_sim_cli.py runs a short smoke test).
Every node writes its step trace into the window's work directory (BATON_STEP_TRACE); the report shows the decode
steps of each load by batch size against the profile's prediction (tools/step_trace.py)."""
import argparse
import fcntl
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CELLS = [("ttft_p50_ms", 0.15), ("ttft_p90_ms", 0.15), ("tpot_p50_ms", 0.15), ("tpot_p90_ms", 0.15),
         ("goodput", 0.10)]
WINDOW_WARN_S = 300


class CmdError(Exception):
    pass


def run(cmd, env=None, capture=True, timeout=None):
    r = subprocess.run([str(c) for c in cmd], env=env, text=True, capture_output=capture, timeout=timeout)
    if r.returncode != 0:
        raise CmdError(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{(r.stderr or '')[-3000:]}")
    return r


def loadavg():
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


HZ = os.sysconf("SC_CLK_TCK")


def busy_cpu_s():
    """CPU seconds the whole machine has spent busy (every CPU, every process) since boot."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq = (int(x) for x in f[:7])
    return (user + nice + system + irq + softirq) / HZ


def steal_cpu_s():
    """CPU seconds the hypervisor gave this machine's virtual CPUs to others while they wanted to run (steal):
    contention from outside the machine, which no process list shows."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return int(f[7]) / HZ if len(f) > 7 else 0.0


def own_children_cpu_s():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cluster_cpu_by_proc(run_dir):
    """CPU seconds of each of the cluster's processes (etcd, router, nodes: their pid files' names), read before
    they stop."""
    return {pid_file.stem: proc_cpu_s(pid_file) for pid_file in Path(run_dir).glob("*.pid")}


def cluster_cpu_s(run_dir):
    """CPU seconds of the cluster's processes together."""
    return sum(cluster_cpu_by_proc(run_dir).values())


# The latency histograms each process exports whose means locate a TTFT gap (process kind: metric names). A decode
# node times its requests from their arrival and its wait for a remote prefill (call and KV transfer); a prefill
# node its calls from arrival to first token, their queueing and the KV push's exposed tail.
PART_METRICS = {"router": ["baton_time_to_first_token_seconds"],
                "decode": ["baton_time_to_first_token_seconds", "baton_remote_prefill_seconds",
                           "baton_queue_time_seconds"],
                "prefill": ["baton_prefill_seconds", "baton_queue_time_seconds", "baton_kv_transfer_seconds"]}


def metrics_urls(run_dir, router_url):
    """The /metrics address of each of the cluster's processes: the router's, and each node's from its log's ready
    line (nodes choose their ports)."""
    urls = {"router": router_url + "/metrics"}
    for log in sorted(Path(run_dir).glob("*.log")):
        m = re.search(r"listening grpc=\S+ http=(\S+)", log.read_text(errors="replace"))
        if m and log.stem.split("-")[0] in PART_METRICS:
            urls[log.stem] = f"http://{m.group(1)}/metrics"
    return urls


def scrape_sums(urls):
    """{process: {metric: [sum, count]}} of the PART_METRICS histograms now (summed over label sets); a process
    that does not answer is left out."""
    out = {}
    for proc, url in urls.items():
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        got = {}
        for name in PART_METRICS[proc.split("-")[0]]:
            sc = [0.0, 0.0]
            for m in re.finditer(rf"^{name}_(sum|count)(?:{{[^}}]*}})? (\S+)$", text, re.M):
                sc[m.group(1) == "count"] += float(m.group(2))
            got[name] = sc
        out[proc] = got
    return out


def part_means_ms(before, after):
    """Mean milliseconds of each histogram over what it observed between the two scrapes, with the count:
    {"decode-1 baton_remote_prefill_seconds": [ms, n], ...}."""
    parts = {}
    for proc, hs in after.items():
        for name, (s1, n1) in hs.items():
            s0, n0 = before.get(proc, {}).get(name, [0.0, 0.0])
            if n1 > n0:
                parts[f"{proc} {name}"] = [round((s1 - s0) / (n1 - n0) * 1e3, 2), int(n1 - n0)]
    return parts


def others_share_now(seconds=10):
    """The CPU share busy over the next few seconds while this script runs nothing: other processes' load."""
    b0, t0 = busy_cpu_s(), time.monotonic()
    time.sleep(seconds)
    return max(0.0, busy_cpu_s() - b0) / ((time.monotonic() - t0) * os.cpu_count())


def wait_until_idle(limit, max_wait_s):
    """Waits (up to max_wait_s) until other processes take less than limit of the CPUs: the quiet file binds only
    those who honour it, and a build or a test suite next door would be measured along with the cluster."""
    end = time.monotonic() + max_wait_s
    while True:
        share = others_share_now()
        if share < limit or time.monotonic() >= end:
            return share
        print(f"  other processes use {100 * share:.0f}% of the CPUs; waiting", file=sys.stderr)
        time.sleep(20)


def quiet_file_stale(path):
    """1 when the quiet file names a holder process (its third field) that no longer runs: a run killed before it
    could remove it. Files without a pid (other tools' protocol) are never stale."""
    try:
        fields = path.read_text().split()
        os.kill(int(fields[2]), 0)
    except (OSError, ValueError, IndexError) as e:
        return isinstance(e, ProcessLookupError)
    return False


class QuietWindow:
    """Holds the quiet file while a measurement runs: others wait while it exists, and so does this."""

    def __init__(self, path, tag):
        self.path = Path(path) if path else None
        self.tag = tag

    def __enter__(self):
        if self.path:
            waited = 0
            while self.path.exists():
                if quiet_file_stale(self.path):
                    print(f"  removing {self.path}: its holder is gone", file=sys.stderr)
                    self.path.unlink(missing_ok=True)
                    continue
                if waited % 60 == 0:
                    print(f"  waiting for {self.path} ({self.path.read_text().strip() if self.path.exists() else ''})",
                          file=sys.stderr)
                time.sleep(5)
                waited += 5
            self.path.write_text(f"{self.tag} {int(time.time())} {os.getpid()}\n")
        self.t0 = time.monotonic()
        self.load_start = loadavg()
        self.busy0, self.own0, self.steal0 = busy_cpu_s(), own_children_cpu_s(), steal_cpu_s()
        self.cluster_s = 0.0
        return self

    def __exit__(self, *exc):
        self.load_end = loadavg()
        self.seconds = time.monotonic() - self.t0
        # what other processes took: all busy time less this measurement's own (its commands and the cluster)
        mine = own_children_cpu_s() - self.own0 + self.cluster_s
        self.others_share = max(0.0, busy_cpu_s() - self.busy0 - mine) / (self.seconds * os.cpu_count())
        self.steal_share = (steal_cpu_s() - self.steal0) / (self.seconds * os.cpu_count())
        if self.path:
            self.path.unlink(missing_ok=True)
        if self.seconds > WINDOW_WARN_S:
            print(f"  warning: the quiet window lasted {self.seconds:.0f} s (more than {WINDOW_WARN_S})",
                  file=sys.stderr)
        return False


class BenchLock:
    """An exclusive flock(2) on a shared lock file for one window: other benchmarks that take the same lock
    (`flock FILE cmd`) neither overlap a window nor wait for the whole run, only for the window in progress."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        if self.path:
            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.path:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()
        return False


def bench_flags(w, slo):
    f = ["--rate", w["rate"], "--prompt-tokens", f"{w['prompt_tokens']}:{w.get('prompt_sd', 0)}",
         "--output-tokens", f"{w['output_tokens']}:{w.get('output_sd', 0)}", "--seed", w.get("seed", 0),
         "--slo-ttft-ms", slo[0], "--slo-tpot-ms", slo[1]]
    return f + (["--requests", w["requests"]] if "requests" in w else ["--duration", w["duration_s"]])


def prio(a):
    """The measured processes (profile, cluster, load generator) run at a raised priority when allowed (and the
    session's autogroup too, main() sets it), so that neighbours who ignore the quiet file slow them less; both
    sides of the comparison run alike."""
    return ["nice", "-n", str(a.nice)] if a.nice else []


def speed_probe(a, baton, pin, out):
    """This host's engine speed now, run as the profile runs (pinned to one thread for 1p1d): `baton bench`'s
    prefill tok/s of a 128-token prompt and batch-1 decode tok/s, medians of 3. Taken before and after the load, it
    says whether the speed the profile measured held through the window."""
    run(prio(a) + pin + [baton, "bench", "--reps", 3, "--decode-tokens", 16, "--json", out]
        + (["--threads", "1"] if pin else []) + (["--model", a.model] if a.model else []))
    b = json.loads(Path(out).read_text())
    return {"prefill_tok_s": b["prefill128_tok_s"], "decode_tok_s": b["decode_tok_s"]}


def probe_request_s(a, baton, url, profile, tmp):
    """The serving path's own time: serial one-token requests at an idle cluster; their median TTFT less the
    profile's step for such a prompt (what the engine spends on them)."""
    out = tmp / "probe.json"
    run(prio(a) + [baton, "bench-serve", "--url", url, "--quiet", "--json", out, "--rate", "inf", "--requests", 12,
         "--concurrency-limit", 1, "--prompt-tokens", 1, "--output-tokens", 1, "--seed", 1])
    r = json.loads(out.read_text())["runs"][0]
    p = json.loads(Path(profile).read_text())
    n = r.get("mean_prompt_tokens") or 1
    # a prompt of a token or two is one pass over the weights and one logits row: a batch-1 decode step (the
    # prefill fit, made on 16..512-token prompts, prices it at a fraction of that)
    step = max(p["prefill"]["fixed_s"] + n * p["prefill"]["token_s"] + p["prefill"].get("seq_s", 0),
               p["decode"]["fixed_s"] + p["decode"]["seq_s"] + n * p["decode"].get("ctx_token_s", 0))
    return max(0.0, r["ttft_ms"]["p50"] / 1e3 - step), r["ttft_ms"]["p50"] / 1e3


def proc_cpu_s(pid_file):
    try:
        f = Path(f"/proc/{int(Path(pid_file).read_text())}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / HZ
    except (OSError, ValueError, IndexError):
        return 0.0


def probe_path_token_s(a, baton, url, run_dir, profile, tmp):
    """What the serving path costs per streamed token on this host, over a few long streams on the idle cluster,
    two ways: the router's and the client's CPU per token (on one host it comes out of some node's cores), and the
    streams' median TPOT less the profile's decode step for their batch and context (what a serving node's step
    costs beyond the profile's loop: its sends, its wake-ups), at one stream and at PATH_BATCH streams at once, so
    that a per-step part and a per-row part can be told apart. Returns (cpu_s, wall_s per batch)."""
    out_tokens, prompt_words = 128, 8
    d = json.loads(Path(profile).read_text())["decode"]
    cpu_s, walls = 0.0, {}
    for batch in (1, PATH_BATCH):
        n = 4 if batch == 1 else 2 * batch
        out = tmp / f"probe-stream-{batch}.json"
        r0, c0 = proc_cpu_s(Path(run_dir) / "router.pid"), own_children_cpu_s()
        run(prio(a) + [baton, "bench-serve", "--url", url, "--quiet", "--json", out, "--rate", "inf", "--requests",
                       n, "--concurrency-limit", batch, "--prompt-tokens", prompt_words, "--output-tokens", out_tokens,
                       "--seed", 2 + batch])
        if batch == 1:
            cpu_s = (proc_cpu_s(Path(run_dir) / "router.pid") - r0 + own_children_cpu_s() - c0) / (n * out_tokens)
        r = json.loads(out.read_text())["runs"][0]
        ctx = (r.get("mean_prompt_tokens") or prompt_words) + out_tokens / 2
        step = step_trace.decode_step_s(d, batch, batch * ctx)
        walls[batch] = max(0.0, r["tpot_ms"]["p50"] / 1e3 - step)
    return cpu_s, walls


PATH_BATCH = 4


def path_split(probes, floor_row_s):
    """The serving node's extra per decode step and per row from the probes' extra TPOT at batch 1 and
    PATH_BATCH: per row the slope (at least floor_row_s), per step what batch 1 leaves."""
    w1, wb = probes["path_wall_s"], probes.get("path_wall_batch_s", probes["path_wall_s"])
    row = max(floor_row_s, (wb - w1) / (PATH_BATCH - 1)) if "path_wall_batch_s" in probes else max(floor_row_s, w1)
    return max(0.0, w1 - row), row


def sim_profile_of(shape, raw, probes):
    """The profile the simulator runs on: the window's `baton profile` plus what the probes measured of the serving
    path (router.request_s per request; router.token_s per streamed token on the decode node's step: the larger of
    the router's and client's CPU per token, which on one host comes out of the engine's cores, and the serial
    streams' extra TPOT)."""
    p = json.loads(json.dumps(raw))
    p.setdefault("router", {})["request_s"] = probes["request_s"]
    if shape == "1p1d":
        # the decode node is pinned to its own core: the streams' extra TPOT is its own (its sends, its wake-ups);
        # the router and the client run on the other core, the prefill node's, and slow its steps
        p["router"]["step_s"], p["router"]["token_s"] = path_split(probes, 0.0)
        p["router"]["prefill_token_s"] = probes["path_cpu_s"]
    else:
        # the router's and the client's CPU per token comes out of the node's cores: at least that much per row
        p["router"]["step_s"], p["router"]["token_s"] = path_split(probes, probes["path_cpu_s"])
    return p


def host_slo(p, w, scale):
    """The run's SLO from this host's own speed (as DistServe scales its SLOs): scale x what one request of the
    workload's mean lengths costs on an idle cluster by the profile p (with the path's probes): TTFT = the serving
    path's request cost and the prefill step of the mean prompt; TPOT = a batch-1 decode step at half the mean
    output, with the path's per-step and per-token costs. A fixed SLO in milliseconds would sit at the median of
    the TTFTs on a slow host (goodput then swings tens of points on a few percent of speed) and far above every
    request on a fast one (goodput 1 whatever the model says): either way it would test nothing."""
    pf, d, r = p["prefill"], p["decode"], p.get("router", {})
    n, o = w["prompt_tokens"], w["output_tokens"]
    ttft = r.get("request_s", 0) + pf.get("fixed_s", 0) + n * pf["token_s"] + pf.get("seq_s", 0)
    tpot = (d["fixed_s"] + d["seq_s"] + (n + o / 2) * d.get("ctx_token_s", 0) + r.get("step_s", 0)
            + r.get("token_s", 0))
    slo = (round(scale * ttft * 1e3), round(scale * tpot * 1e3, 1))
    return slo, {"scale": scale, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "prompt_tokens": n,
                 "output_tokens": o}


def speed_ratio(rows, row):
    """The window's prefill time per token (its profile's) over the median of the run's clean windows so far and
    this one (a disturbed window's speed is no reference): a host whose speed moves while nothing visible runs (a
    sibling hyperthread, the clock) slows a window the profile measured at another speed; --max-speed-moved marks
    such a window disturbed."""
    ref = statistics.median([r["profile"]["prefill_token_ms"] for r in rows if not r.get("disturbed")]
                            + [row["profile"]["prefill_token_ms"]])
    return row["profile"]["prefill_token_ms"] / ref


def load_speed_ratio(row):
    """A window's prefill speed during its load against its profile's. 1P+1D: the prefill node's CPU seconds over the
    load per prompt token it computed (it runs nothing else, pinned to its core) over the profile's prefill time per
    token. Colocated: the median ratio of the decode node's one-prompt steps during the load (a step that computed
    one prompt's tokens and no decode row) to the profile's price for each, from its step trace. None when neither is
    known. Far from 1, the host ran the load at another speed than the profile measured (in session 8 a 1.5 req/s
    1P+1D window's prefill took 2.21 ms of CPU per token against the profile's 1.80, and its measured TTFT p50 was 33%
    above the simulated one; in session 13 a colocated 1 req/s window's one-prompt steps ran at 0.83x the profile's
    prices, its speed probes before and after the load agreed with the load, and the simulated TTFT p50 came out 17%
    above the measured one)."""
    cpu = row.get("load_cpu_s", {}).get("prefill-1")
    tokens = row.get("requests", 0) * row.get("mean_prompt_tokens", 0)
    if cpu and tokens > 0:
        return cpu * 1e3 / tokens / row["profile"]["prefill_token_ms"]
    if "prefill-1" in row.get("load_cpu_s", {}):
        return None
    r = [v["prefill"]["vs_profile"] for k, v in row.get("steps", {}).items() if k.startswith("decode-")
         and "vs_profile" in v.get("prefill", {})]
    return statistics.median(r) if r else None


def decode_speed_ratio(row):
    """The decode node's speed during the load against its profile's: the median ratio of its decode-only steps
    (those no other node's step overlapped) to what the profile prices them at, from its step trace; None without
    one. Far from 1, the host ran the load's decode steps at another speed than the profile measured (a 1P+1D
    window in session 13 ran its lone batch-1 steps at 1.12x the profile's, and its TPOT p90 came out 22% above
    the simulated one)."""
    r = [v["lone_vs_profile"] for k, v in row.get("steps", {}).items() if k.startswith("decode-")
         and "lone_vs_profile" in v]
    return statistics.median(r) if r else None


def measure(a, wpath, rep, tmp):
    """One quiet window: profile, cluster, probe, bench. Returns the measured row and the profile used."""
    baton = Path(a.build) / "bin" / "baton"
    w = json.loads(Path(wpath).read_text().strip().splitlines()[0])
    tag = f"{Path(wpath).stem}-{rep}"
    pin = ["taskset", "-c", "1"] if a.shape == "1p1d" else []
    # router HTTP, router gRPC, etcd client, etcd peer (the launcher takes the next port after the client's)
    env = dict(os.environ, BATON_BUILD_DIR=a.build, BATON_RUN_DIR=str(tmp / f"run-{tag}"),
               BATON_HTTP_LISTEN=f"127.0.0.1:{a.port_base}", BATON_GRPC_LISTEN=f"127.0.0.1:{a.port_base + 1}",
               BATON_ETCD_LISTEN=f"127.0.0.1:{a.port_base + 2}")
    # every node's step trace (tools/step_trace.py reads them); a window measured again gets a directory of its own
    trace_dir = Path(tempfile.mkdtemp(prefix=f"steps-{tag}-", dir=tmp))
    env["BATON_STEP_TRACE"] = str(trace_dir)
    url = f"http://127.0.0.1:{a.port_base}"
    up = [ROOT / "deploy/local/cluster", "up", "--detach"] + (["--model", a.model] if a.model else [])
    up += ["--prefill", "1", "--decode", "1", "--prefill-cpus", "0", "--decode-cpus", "1",
           "--router-args", "--prefill-mode remote"] if a.shape == "1p1d" else ["--prefill", "0", "--decode", "1"]
    with QuietWindow(a.quiet_file, a.quiet_tag) as qw:
        profile = a.profile
        if not profile:
            profile = tmp / f"profile-{tag}.json"
            # the profile runs as the nodes do: pinned to one CPU with one thread for 1p1d, every core colocated
            run(prio(a) + pin + [baton, "profile", "--reps", a.profile_reps, "--out", profile]
                + (["--threads", "1"] if pin else []) + (["--model", a.model] if a.model else []))
        try:
            run(prio(a) + up, env=env)
            # first-request costs (page faults, caches) stay out of the measured runs
            run([baton, "bench-serve", "--url", url, "--quiet", "--rate", "inf", "--requests", 4,
                 "--prompt-tokens", 64, "--output-tokens", 16])
            request_s, probe_ttft = probe_request_s(a, baton, url, profile, tmp)
            path_cpu_s, path_walls = probe_path_token_s(a, baton, url, env["BATON_RUN_DIR"], profile, tmp)
            raw = json.loads(Path(profile).read_text())
            probes = {"request_s": request_s, "path_cpu_s": path_cpu_s, "path_wall_s": path_walls[1],
                      "path_wall_batch_s": path_walls[PATH_BATCH]}
            p = sim_profile_of(a.shape, raw, probes)
            if a.slo is None:  # the first window sets the run's SLO from what it measured of this host
                a.slo, a.slo_basis = host_slo(p, w, a.slo_scale)
                print(f"  SLO for this run: TTFT {a.slo[0]:g} ms, TPOT {a.slo[1]:g} ms ({a.slo_scale:g} x the "
                      f"unloaded {a.slo_basis['ttft_ms']:.1f} ms and {a.slo_basis['tpot_ms']:.2f} ms)", file=sys.stderr)
            out = tmp / f"bench-{tag}.json"
            speed = [speed_probe(a, baton, pin, tmp / f"speed-{tag}-0.json")]
            # others' share during the measured load itself: a window's average can hide a burst that fell on it
            b0, o0, t0 = busy_cpu_s(), own_children_cpu_s(), time.monotonic()
            p0, s0 = cluster_cpu_by_proc(env["BATON_RUN_DIR"]), steal_cpu_s()
            murls = metrics_urls(env["BATON_RUN_DIR"], url)
            m0 = scrape_sums(murls)
            run(prio(a) + [baton, "bench-serve", "--url", url, "--quiet", "--json", out] + bench_flags(w, a.slo))
            t_load = (t0, time.monotonic())
            parts = part_means_ms(m0, scrape_sums(murls))
            # where the load's CPU went, per process (the client is this script's children): on one host the
            # router's and the client's share lands on whichever core is free
            load_cpu = {k: round(v - p0.get(k, 0.0), 3) for k, v in cluster_cpu_by_proc(env["BATON_RUN_DIR"]).items()}
            load_cpu["client"] = round(own_children_cpu_s() - o0, 3)
            mine = sum(load_cpu.values())
            bench_others = max(0.0, busy_cpu_s() - b0 - mine) / ((time.monotonic() - t0) * os.cpu_count())
            bench_steal = (steal_cpu_s() - s0) / ((time.monotonic() - t0) * os.cpu_count())
            speed.append(speed_probe(a, baton, pin, tmp / f"speed-{tag}-1.json"))
        finally:
            qw.cluster_s = cluster_cpu_s(env["BATON_RUN_DIR"])
            subprocess.run([str(ROOT / "deploy/local/cluster"), "down"], env=env, capture_output=True)
    real = json.loads(out.read_text())["runs"][0]
    steps = step_trace.summarize(trace_dir, t_load[0], t_load[1], raw)
    sim_profile = tmp / f"sim-profile-{tag}-{int(time.time())}.json"
    sim_profile.write_text(json.dumps(p))
    row = {"workload": str(wpath), "rate": w["rate"], "rep": rep, "requests": real["requests"],
           "load_start": qw.load_start, "load_end": qw.load_end, "window_s": round(qw.seconds, 1),
           "others_cpu_share": round(qw.others_share, 3), "others_bench_share": round(bench_others, 3),
           "steal_share": round(qw.steal_share, 3), "steal_bench_share": round(bench_steal, 3),
           "profile": {"prefill_token_ms": p["prefill"]["token_s"] * 1e3, "prefill_seq_ms": p["prefill"].get("seq_s", 0) * 1e3,
                       "decode_fixed_ms": p["decode"]["fixed_s"] * 1e3, "decode_seq_ms": p["decode"]["seq_s"] * 1e3,
                       "request_ms": request_s * 1e3, "probe_ttft_ms": probe_ttft * 1e3,
                       "path_token_ms": p["router"]["token_s"] * 1e3, "path_token_cpu_ms": path_cpu_s * 1e3,
                       "path_token_wall_ms": path_walls[1] * 1e3,
                       "path_token_wall_batch_ms": path_walls[PATH_BATCH] * 1e3,
                       "path_step_ms": p["router"]["step_s"] * 1e3,
                       "prefill_spread": p["prefill"].get("spread", 0), "decode_spread": p["decode"].get("spread", 0),
                       "idle_extra_ms": [round(e * 1e3, 2) for e in p.get("idle", {}).get("extra_s", [])]},
           "load_cpu_s": load_cpu, "load_s": real.get("duration_s", 0),
           # the engine's speed before and after the load (speed_probe), and the prefill speed's ratio after/before
           "speed_probes": speed, "speed_drift": round(speed[1]["prefill_tok_s"] / speed[0]["prefill_tok_s"], 3),
           "ttft_parts_ms": dict(parts, **{"client ttft": [round(real["ttft_ms"].get("mean", 0), 2),
                                                           real["requests"]]}),
           "output_tok_s": real.get("throughput_output_tok_s", 0),
           "mean_prompt_tokens": real.get("mean_prompt_tokens", 0),
           "raw_profile": raw, "probes": probes, "steps": steps,
           "real": {"ttft_p50_ms": real["ttft_ms"]["p50"], "ttft_p90_ms": real["ttft_ms"]["p90"],
                    "tpot_p50_ms": real["tpot_ms"]["p50"], "tpot_p90_ms": real["tpot_ms"]["p90"],
                    "goodput": real["good_requests"] / max(1, real["requests"])}}
    return row, sim_profile


def simulate(a, wpath, sim_profile):
    baton = Path(a.build) / "bin" / "baton"
    shape = ["--prefill", "1", "--decode", "1", "--prefill-mode", "remote"] if a.shape == "1p1d" else ["--decode", "1"]
    sim = json.loads(run([baton, "simulate", "--profile", sim_profile, "--workload", wpath, "--json", "-",
                          "--slo-ttft-ms", a.slo[0], "--slo-tpot-ms", a.slo[1]] + shape).stdout)
    return {"ttft_p50_ms": sim["ttft"]["p50_s"] * 1e3, "ttft_p90_ms": sim["ttft"]["p90_s"] * 1e3,
            "tpot_p50_ms": sim["tpot"]["p50_s"] * 1e3, "tpot_p90_ms": sim["tpot"]["p90_s"] * 1e3,
            "goodput": sim["good"] / max(1, sim["arrived"]),
            # the means of a TTFT and of a remote prefill's parts (sim.h), to set against the nodes' histograms
            "ttft_mean_ms": sim["ttft"]["mean_s"] * 1e3, "on_prefill_mean_ms": sim["prefill_node"]["mean_s"] * 1e3,
            "after_prefill_mean_ms": sim["after_prefill"]["mean_s"] * 1e3}


def summarize(rows, workloads):
    """Per workload and cell: medians over the repetitions, the error and the verdict."""
    table = []
    for wpath in workloads:
        rs = [r for r in rows if r["workload"] == str(wpath)]
        if not rs:
            continue
        # per repetition, its clean window, else its last (disturbed) one; disturbed repetitions only when no
        # repetition of this load was clean
        per_rep = {}
        for r in rs:
            if r["rep"] not in per_rep or per_rep[r["rep"]].get("disturbed", False):
                per_rep[r["rep"]] = r
        rs = list(per_rep.values())
        if any(not r.get("disturbed") for r in rs):
            rs = [r for r in rs if not r.get("disturbed")]
        for cell, tol in CELLS:
            real = statistics.median(r["real"][cell] for r in rs)
            sim = statistics.median(r["sim"][cell] for r in rs)
            err = (sim - real) / real if real else (0.0 if sim == real else float("inf"))
            table.append({"workload": str(wpath), "rate": rs[0]["rate"], "cell": cell, "n": len(rs),
                          "disturbed": sum(bool(r.get("disturbed")) for r in rs),
                          "measured": real, "simulated": sim, "error": err, "target": tol, "pass": abs(err) <= tol})
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="*")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", help="use this profile instead of profiling in each window")
    ap.add_argument("--profile-reps", type=int, default=3, help="baton profile --reps (default 3)")
    ap.add_argument("--shape", choices=["colocated", "1p1d"], default="colocated")
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--model", help="GGUF file (default: the launcher's default model)")
    # goodput's SLO: by default a multiple of this host's unloaded latency (host_slo), so that goodput tests the
    # model on a slow host and a fast one alike
    ap.add_argument("--slo-ttft-ms", type=float, help="a fixed TTFT SLO (with --slo-tpot-ms; default: --slo-scale)")
    ap.add_argument("--slo-tpot-ms", type=float)
    ap.add_argument("--slo-scale", type=float, default=2.0,
                    help="without fixed SLOs: TTFT and TPOT SLOs of this many times what the first window measures "
                         "one request of its workload to cost on the idle cluster (default 2)")
    ap.add_argument("--max-speed-moved", type=float, default=0.2,
                    help="a window whose profile's prefill ms/token is more than this fraction off the median of "
                         "the run's windows, or whose prefill speed after the load is more than this fraction off "
                         "the speed before it, or (1p1d) whose decode node's lone decode steps (its step trace) "
                         "during the load are more than this fraction off the profile's, is disturbed (the host's "
                         "speed moved; default 0.2; 1 = off)")
    ap.add_argument("--max-load-speed-moved", type=float, default=0.1,
                    help="a window whose prefill during the load (1p1d: the prefill node's CPU per prompt token; "
                         "colocated: the decode node's one-prompt steps, its step trace) ran more than this fraction "
                         "off the profile's price is disturbed: the simulator's TTFT error follows that speed error "
                         "about one for one (default 0.1; 1 = off)")
    ap.add_argument("--port-base", type=int, default=18700,
                    help="router HTTP on this port, its gRPC, etcd and etcd's peer port on the next three")
    ap.add_argument("--quiet-file", default="/tmp/QUIET", help="'' = no quiet protocol")
    ap.add_argument("--quiet-tag", default="sim_validate")
    ap.add_argument("--lock", default="/tmp/baton-bench.lock",
                    help="flock this file for each window (what `flock FILE cmd` takes; '' = none)")
    ap.add_argument("--gap-s", type=float, default=20,
                    help="pause between quiet windows so that others can take a turn (default 20)")
    ap.add_argument("--max-others", type=float, default=0.15,
                    help="a window where other processes plus the hypervisor's steal (other guests on the host) "
                         "took more than this share of the CPUs is disturbed: it "
                         "is measured again (--retries) and left out of the medians when a clean one exists; "
                         "windows start once others use less (1 = off; default 0.15)")
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--nice", type=int, default=-20,
                    help="niceness of the measured processes and of this session's autogroup (default -20 where "
                         "permitted, else 0)")
    ap.add_argument("--max-wait-s", type=float, default=900, help="longest wait for others to go idle (default 900)")
    ap.add_argument("--json")
    ap.add_argument("--no-targets", action="store_true", help="exit 0 even when a target is missed")
    ap.add_argument("--resimulate", metavar="JSON",
                    help="measure nothing: simulate again the windows a --json file of an earlier run recorded "
                         "(their profiles and probes) with this build, and compare with their measurements")
    a = ap.parse_args()
    # a stopped run ends its window as any other way out does: the cluster down, the quiet file removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if (a.slo_ttft_ms is None) != (a.slo_tpot_ms is None):
        ap.error("--slo-ttft-ms and --slo-tpot-ms go together (or neither: --slo-scale)")
    a.slo = (a.slo_ttft_ms, a.slo_tpot_ms) if a.slo_ttft_ms is not None else None
    a.slo_basis = None
    if a.resimulate:
        return resimulate(a)
    if a.nice and subprocess.run(["nice", "-n", str(a.nice), "true"], capture_output=True).returncode != 0:
        a.nice = 0
    if a.nice:
        try:  # with autogroups a niceness counts only inside the session: the session's own weight too
            Path("/proc/self/autogroup").write_text(str(a.nice))
        except OSError:
            pass
    workloads = [Path(w) for w in a.workloads] or sorted((ROOT / "tools/workloads").glob("validate-*.json"),
                                                         key=lambda p: json.loads(p.read_text())["rate"])
    tmp = Path(tempfile.mkdtemp(prefix="sim-validate-"))
    rows = []
    try:
        for rep in range(a.repeats):
            for wpath in workloads:
                if rows:
                    time.sleep(a.gap_s)
                for attempt in range(a.retries + 1):
                    with BenchLock(a.lock):
                        before = wait_until_idle(a.max_others, a.max_wait_s) if a.max_others < 1 else 0.0
                        print(f"window: {wpath.name}, repetition {rep + 1} of {a.repeats} (others "
                              f"{100 * before:.0f}% before) ...", file=sys.stderr)
                        row, sim_profile = measure(a, wpath, rep, tmp)
                    row["sim"] = simulate(a, wpath, sim_profile)
                    row["others_before"] = round(before, 3)
                    # other processes here, and the hypervisor's steal: other guests on the same host
                    row["speed_ratio"] = round(speed_ratio(rows, row), 3)
                    lsr, dsr = load_speed_ratio(row), decode_speed_ratio(row)
                    row["load_speed_ratio"] = round(lsr, 3) if lsr is not None else 1.0
                    row["decode_speed_ratio"] = round(dsr, 3) if dsr is not None else 1.0
                    # the host's speed moved: from the run's other windows, or within this one (before and after
                    # its load)
                    moved = a.max_speed_moved < 1 and max(abs(row["speed_ratio"] - 1), abs(row["speed_drift"] - 1),
                                                          # colocated, the router shares the decode node's cores
                                                          abs(row["decode_speed_ratio"] - 1) if a.shape == "1p1d"
                                                          else 0) > a.max_speed_moved
                    moved = moved or (a.max_load_speed_moved < 1 and
                                      abs(row["load_speed_ratio"] - 1) > a.max_load_speed_moved)
                    row["disturbed"] = moved or max(row["others_cpu_share"] + row["steal_share"],
                                                    row["others_bench_share"] + row["steal_bench_share"]) > a.max_others
                    rows.append(row)
                    if a.json:  # as it goes: a run cut short keeps its windows
                        write_json(a, rows, summarize(rows, workloads))
                    if not row["disturbed"]:
                        break
                    print(f"  disturbed: other processes took {100 * row['others_cpu_share']:.0f}% of the CPUs "
                          f"({100 * row['others_bench_share']:.0f}% during the load), the hypervisor stole "
                          f"{100 * row['steal_share']:.0f}% ({100 * row['steal_bench_share']:.0f}%); prefill speed "
                          f"x{row['speed_ratio']:.2f} of the run's median, x{row['speed_drift']:.2f} after the load "
                          f"than before, prefill during the load x{row['load_speed_ratio']:.2f} the "
                          f"profile's, decode steps x{row['decode_speed_ratio']:.2f} the profile's", file=sys.stderr)
                print(f"  load {row['load_start']} -> {row['load_end']}, {row['window_s']} s, other processes "
                      f"{100 * row['others_cpu_share']:.0f}% of the CPUs; measured "
                      + ", ".join(f"{k} {v:.3g}" for k, v in row["real"].items()), file=sys.stderr)
    except CmdError as e:
        print(f"sim_validate: {e}", file=sys.stderr)
        return 2
    return report(a, rows, workloads, tmp)


def resimulate(a):
    old = json.loads(Path(a.resimulate).read_text())
    a.shape, a.slo, a.repeats = old["shape"], tuple(old["slo_ms"]), old["repeats"]
    a.slo_basis = old.get("slo_basis")
    rows = [r for r in old["rows"] if "raw_profile" in r]
    if not rows:
        print(f"sim_validate: {a.resimulate} records no profiles (an older run's file)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="sim-resimulate-"))
    workloads = []
    for i, r in enumerate(rows):
        if Path(r["workload"]) not in workloads:
            workloads.append(Path(r["workload"]))
        sp = tmp / f"sim-profile-{i}.json"
        sp.write_text(json.dumps(sim_profile_of(a.shape, r["raw_profile"], r["probes"])))
        try:
            r["sim"] = simulate(a, r["workload"], sp)
        except CmdError as e:
            print(f"sim_validate: {e}", file=sys.stderr)
            return 2
    return report(a, rows, workloads, tmp)


def write_json(a, rows, table):
    Path(a.json).write_text(json.dumps({"shape": a.shape, "slo_ms": a.slo, "slo_basis": a.slo_basis,
                                        "repeats": a.repeats, "rows": rows, "table": table}, indent=1))


def report(a, rows, workloads, tmp):
    """Prints the table and each window's conditions, writes --json; the exit status."""
    table = summarize(rows, workloads)
    basis = (f" ({a.slo_basis['scale']:g} x this host's unloaded {a.slo_basis['ttft_ms']:.1f} ms and "
             f"{a.slo_basis['tpot_ms']:.2f} ms)" if a.slo_basis else "")
    print(f"shape {a.shape}; SLO TTFT {a.slo[0]:g} ms, TPOT {a.slo[1]:g} ms{basis}; medians over {a.repeats} "
          f"repetition(s); work files under {tmp}")
    print(f"{'load':>6} {'cell':<12} {'measured':>10} {'simulated':>10} {'error':>8} {'target':>7}  verdict")
    for t in table:
        print(f"{t['rate']:>6g} {t['cell']:<12} {t['measured']:>10.4g} {t['simulated']:>10.4g} {100 * t['error']:>+7.1f}% "
              f"{'±' + format(100 * t['target'], 'g') + '%':>7}  {'pass' if t['pass'] else 'FAIL'}")
    print("each window: load averages (1/5/15 min) at its start and end, the CPU share other processes took:")
    for r in rows:
        print(f"  {Path(r['workload']).stem} #{r['rep'] + 1}: {r['load_start']} -> {r['load_end']} "
              f"({r['window_s']} s, prefill speed x{r.get('speed_ratio', 1):.2f} of the median"
              # an older run's rows lack the in-window checks: say nothing rather than a made-up 1.00
              + (f" and x{r['speed_drift']:.2f} after the load than before" if "speed_drift" in r else "")
              + (f", prefill CPU per token in the load x{r['load_speed_ratio']:.2f} the profile's"
                 if r.get("load_cpu_s", {}).get("prefill-1") and "load_speed_ratio" in r else
                 f", one-prompt steps in the load x{r['load_speed_ratio']:.2f} the profile's"
                 if any("vs_profile" in v.get("prefill", {}) for v in r.get("steps", {}).values()) else "")
              + (f", lone decode steps in the load x{r['decode_speed_ratio']:.2f} the profile's"
                 if "decode_speed_ratio" in r else "")
              + f", others {100 * r['others_cpu_share']:.0f}%, {100 * r.get('others_bench_share', 0):.0f}% "
              f"during the load, steal {100 * r.get('steal_share', 0):.0f}%, {100 * r.get('steal_bench_share', 0):.0f}% "
              f"during the load{', disturbed' if r.get('disturbed') else ''}); profile prefill {r['profile']['prefill_token_ms']:.3f} ms/token, decode "
              f"{r['profile']['decode_fixed_ms']:.2f} ms + {r['profile']['decode_seq_ms']:.2f} ms/seq, path "
              f"{r['profile']['request_ms']:.1f} ms + {r['profile'].get('path_step_ms', 0):.2f} ms/step + "
              f"{r['profile'].get('path_token_ms', 0):.2f} ms/token, spread "
              f"{r['profile'].get('prefill_spread', 0):.2f}/{r['profile'].get('decode_spread', 0):.2f}, idle extra "
              f"{r['profile'].get('idle_extra_ms', [])} ms"
              + (f"; the load's CPU seconds over {r['load_s']:.0f} s: "
                 + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["load_cpu_s"].items())) if "load_cpu_s" in r else ""))
        sim = r["sim"]
        if "ttft_mean_ms" in sim:  # where a TTFT goes: each process's histogram means over the load, and the model's
            print("    TTFT means, ms: measured "
                  + ", ".join(f"{k.replace('baton_', '').replace('_seconds', '')} {v[0]:.1f}"
                              for k, v in sorted(r.get("ttft_parts_ms", {}).items()))
                  + f"; simulated ttft {sim['ttft_mean_ms']:.1f}"
                  + (f", on the prefill node {sim['on_prefill_mean_ms']:.1f}, then to the first token "
                     f"{sim['after_prefill_mean_ms']:.1f}" if sim.get("on_prefill_mean_ms") else ""))
        if r.get("steps"):  # the engines' own step traces over the load (tools/step_trace.py)
            step_trace.print_summary({k: v for k, v in r["steps"].items() if v["decode"]}, indent="    ")
    if a.json:
        write_json(a, rows, table)
    missed = sum(not t["pass"] for t in table)
    print(f"{len(table) - missed} of {len(table)} cells within target"
          + (f" (medians include {max(t['disturbed'] for t in table)} disturbed window(s) per load)"
             if any(t["disturbed"] for t in table) else ""))
    return 1 if missed and not a.no_targets else 0


if __name__ == "__main__":
    sys.exit(main())
