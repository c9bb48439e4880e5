"""Chapter 05: plausible wrong answers its checks must reject (see ``_mutations.py``).

Every edge the exercises name — machines that run no process, node lists with ranges and several
groups, the collective on either rank, sizes near 64 GiB and an even number of repeats, clusters that
are not square, one process, an empty tensor, an unknown collective — is in the visible checks, so
the wrong answers that miss one are VISIBLE (issue 38). The hidden checks add sizes and randomness
only (larger clusters, random node lists, 3 ranks, random message sizes, any port, thousands of
processes); their wrong answers are ones that only those expose.
"""

from _mutations import chapter_tests

SLURM_TAIL = """\
return gc.DistEnv(rank=int(environ["SLURM_PROCID"]), local_rank=int(environ["SLURM_LOCALID"]),
                  world_size=int(environ["SLURM_NTASKS"]), master_addr=addr, master_port=port,
                  node_rank=int(environ["SLURM_NODEID"]),
                  nproc_per_node=int(environ["SLURM_NTASKS_PER_NODE"]),
                  nnodes=int(environ["SLURM_NNODES"]), source="slurm")
"""
SLURM_CHECK = """\
missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID") if k not in environ]
if missing:
    raise ValueError(f"SLURM environment is missing {', '.join(missing)}")
"""
SLURM_ADDR = """\
addr = environ["MASTER_ADDR"] if "MASTER_ADDR" in environ else gc.expand_slurm_nodelist(environ["SLURM_JOB_NODELIST"])[0]
"""
SLURM_PORT = """\
port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else 15000 + int(environ["SLURM_JOB_ID"]) % 10000
"""

DIAGNOSE = """\
try:
    results = gc.launch(program, world_size, init_process_group=False, timeout=30)
except gc.WorkerError as err:
    if "init_process_group" in err.remote_traceback:
        return ("world_size", None)
    return ("collective", {rank})
if {same_order}:
    return ("set_epoch", None)
return ("ok", None)
"""
EVERY_EPOCH_SAME = "any(len(epochs) > 1 and all(e == epochs[0] for e in epochs) for epochs in results)"

PING = """\
one_way = []
for n in sizes:
    message = torch.empty(n, dtype=torch.uint8)
    round_trips = []
    for i in range({trips}):
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, dst=1)
            dist.recv(message, src=1)
        else:
            dist.recv(message, src=0)
            dist.send(message, dst=0)
        if i >= {skip}:
            round_trips.append(time.perf_counter() - start)
    one_way.append({summary})
return one_way if rank == 0 else None
"""
RIGHT_PING = {"trips": "repeats + 1", "skip": 1, "summary": "statistics.median(round_trips) / 2"}
SEND_ONLY = """\
one_way = []
for n in sizes:
    message = torch.empty(n, dtype=torch.uint8)
    sends = []
    for i in range(repeats + 1):
        if rank == 0:
            start = time.perf_counter()
            dist.send(message, dst=1)
            if i > 0:
                sends.append(time.perf_counter() - start)      # the send alone: one message, no halving
            dist.recv(message, src=1)
        else:
            dist.recv(message, src=0)
            dist.send(message, dst=0)
    one_way.append(statistics.median(sends) if rank == 0 else None)
return one_way if rank == 0 else None
"""

ENV = """\
nnodes = len(node_addrs)
return {{"MASTER_ADDR": {addr}, "MASTER_PORT": str(master_port),
        "RANK": str({rank}), "WORLD_SIZE": str(nnodes * nproc_per_node),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str({local_world}),
        "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes)}}
"""
RIGHT_ENV = {"addr": "node_addrs[0]", "rank": "node_rank * nproc_per_node + local_rank", "local_world": "nproc_per_node"}

COLLECTIVE = """\
if kind not in ("reduce_scatter", "all_gather", "all_reduce"):
    raise ValueError(kind)
p = world_size
{body}
"""

VISIBLE = {
    "05.1": {
        "the lesson's formula with this machine's count": """\
table = [[node * n + local for local in range(n)] for node, n in enumerate(gpus_per_node)]
return sum(gpus_per_node), table
""",
        "the first machine's count for all": """\
n0 = gpus_per_node[0]
return sum(gpus_per_node), [[node * n0 + local for local in range(n)] for node, n in enumerate(gpus_per_node)]
""",
        "numbered local rank first": """\
table = [[] for _ in gpus_per_node]
rank = 0
for local in range(max(gpus_per_node)):
    for node, n in enumerate(gpus_per_node):
        if local < n:
            table[node].append(rank)
            rank += 1
return rank, table
""",
        "world size from the largest machine": """\
table, first = [], 0
for count in gpus_per_node:
    table.append(list(range(first, first + count)))
    first += count
return len(gpus_per_node) * max(gpus_per_node), table
""",
        "a tensor, not lists": """\
table, first = [], 0
for count in gpus_per_node:
    table.append(torch.arange(first, first + count))
    first += count
return first, table
""",
        "machines without processes dropped": """\
rows = {}
rank = 0
for node, n in enumerate(gpus_per_node):
    for local in range(n):
        rows.setdefault(node, []).append(rank)
        rank += 1
return rank, [rows[node] for node in sorted(rows)]
""",
    },
    "05.2": {
        "the port as a string": SLURM_CHECK + SLURM_ADDR + """\
port = environ["MASTER_PORT"] if "MASTER_PORT" in environ else str(15000 + int(environ["SLURM_JOB_ID"]) % 10000)
""" + SLURM_TAIL,
        "no modulo in the port": SLURM_CHECK + SLURM_ADDR + """\
port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else 15000 + int(environ["SLURM_JOB_ID"])
""" + SLURM_TAIL,
        "the last host": SLURM_CHECK + """\
addr = environ["MASTER_ADDR"] if "MASTER_ADDR" in environ else gc.expand_slurm_nodelist(environ["SLURM_JOB_NODELIST"])[-1]
""" + SLURM_PORT + SLURM_TAIL,
        "MASTER_ADDR ignored": SLURM_CHECK + """\
addr = gc.expand_slurm_nodelist(environ["SLURM_JOB_NODELIST"])[0]
""" + SLURM_PORT + SLURM_TAIL,
        "a KeyError for a missing variable": SLURM_ADDR + SLURM_PORT + SLURM_TAIL,
        "a ValueError that names nothing": """\
if any(k not in environ for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID")):
    raise ValueError("not a complete SLURM environment")
""" + SLURM_ADDR + SLURM_PORT + SLURM_TAIL,
        "calls the forbidden helper": "return gc.dist_env_from(environ)",
        # ported from test_hidden_checks.py WRONG_ANSWERS["05.2"]: "prefix[a,b,...]" -> prefix + a
        "the node list cut at the bracket": SLURM_CHECK + """\
if "MASTER_ADDR" in environ:
    addr = environ["MASTER_ADDR"]
else:
    prefix, _, rest = environ["SLURM_JOB_NODELIST"].partition("[")
    addr = prefix + rest.split(",")[0].rstrip("]")
""" + SLURM_PORT + SLURM_TAIL,
    },
    "05.3": {
        # ported from test_visible_checks.py VISIBLE_WRONG["05.3"]: the rendezvous that never completes is missed
        "every failure read as a collective": """\
try:
    results = gc.launch(program, world_size, init_process_group=False, timeout=30)
except gc.WorkerError as err:
    return ("collective", err.rank)
if any(len(epochs) > 1 and all(e == epochs[0] for e in epochs) for epochs in results):
    return ("set_epoch", None)
return ("ok", None)
""",
        # ported from test_hidden_checks.py WRONG_ANSWERS["05.3"] (caught by the visible check now)
        "the rank under `if rank == 0`": DIAGNOSE.format(rank="0", same_order=EVERY_EPOCH_SAME),
        "set_epoch read as ranks seeing the same samples": DIAGNOSE.format(
            rank="err.rank", same_order="any(results[0][e] == results[1][e] for e in range(len(results[0])))"),
        "the collective on the last rank": DIAGNOSE.format(rank="world_size - 1", same_order=EVERY_EPOCH_SAME),
    },
    "05.4": {
        # ported from test_visible_checks.py VISIBLE_WRONG["05.4"]: a round trip counted as one message
        "a round trip counted as one message": [PING.format(**{**RIGHT_PING, "summary": "statistics.median(round_trips)"}), None],
        "the mean, not the median": [PING.format(**{**RIGHT_PING, "summary": "sum(round_trips) / len(round_trips) / 2"}), None],
        "no warm-up": [PING.format(**{**RIGHT_PING, "trips": "repeats", "skip": 0}), None],
        "only the send timed": [SEND_ONLY, None],
        # ported from test_hidden_checks.py WRONG_ANSWERS["05.4"] (caught by the visible check now)
        "the line through two points": [None, """\
beta = (times[-1] - times[0]) / (sizes[-1] - sizes[0])
return times[0] - beta * sizes[0], beta
"""],
        "(beta, alpha)": [None, """\
n = len(sizes)
mean_n, mean_t = sum(sizes) / n, sum(times) / n
beta = sum((x - mean_n) * (y - mean_t) for x, y in zip(sizes, times)) / sum((x - mean_n) ** 2 for x in sizes)
return beta, mean_t - beta * mean_n
"""],
        "calls the forbidden helper": [None, """\
link = gc.fit_alpha_beta(sizes, times)
return link.alpha, link.beta
"""],
        "the textbook sums, uncentered": [None, """\
n = len(sizes)
sx, sy = sum(sizes), sum(times)
sxx, sxy = sum(x * x for x in sizes), sum(x * y for x, y in zip(sizes, times))
beta = (n * sxy - sx * sy) / (n * sxx - sx * sx)
return (sy - beta * sx) / n, beta
"""],
    },
    "05.5": {
        # ported from test_visible_checks.py VISIBLE_WRONG["05.5"]: the world size in LOCAL_WORLD_SIZE
        "the world size in LOCAL_WORLD_SIZE": ENV.format(**{**RIGHT_ENV, "local_world": "nnodes * nproc_per_node"}),
        # ported from test_hidden_checks.py WRONG_ANSWERS["05.5"] (caught by the visible check now)
        "ints, not strings": """\
nnodes = len(node_addrs)
return {"MASTER_ADDR": node_addrs[0], "MASTER_PORT": master_port,
        "RANK": node_rank * nproc_per_node + local_rank, "WORLD_SIZE": nnodes * nproc_per_node,
        "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": nproc_per_node, "GROUP_RANK": node_rank,
        "GROUP_WORLD_SIZE": nnodes}
""",
        "each machine its own address": ENV.format(**{**RIGHT_ENV, "addr": "node_addrs[node_rank]"}),
        "numbered local rank first": ENV.format(**{**RIGHT_ENV, "rank": "local_rank * len(node_addrs) + node_rank"}),
        "GROUP_RANK and GROUP_WORLD_SIZE forgotten": """\
nnodes = len(node_addrs)
return {"MASTER_ADDR": node_addrs[0], "MASTER_PORT": str(master_port),
        "RANK": str(node_rank * nproc_per_node + local_rank), "WORLD_SIZE": str(nnodes * nproc_per_node),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc_per_node)}
""",
        "RANK counted with the number of machines": ENV.format(**{**RIGHT_ENV, "rank": "node_rank * len(node_addrs) + local_rank"}),
    },
    "05.6": {
        "the all-reduce's time for all three": COLLECTIVE.format(body="return 2 * (p - 1) * (alpha + beta * nbytes / p)"),
        "p rounds, not p - 1": COLLECTIVE.format(
            body="rounds = 2 * p if kind == 'all_reduce' else p\nreturn rounds * (alpha + beta * nbytes / p)"),
        "whole tensors in every message": COLLECTIVE.format(
            body="rounds = 2 * (p - 1) if kind == 'all_reduce' else p - 1\nreturn rounds * (alpha + beta * nbytes)"),
        "the latency paid once": COLLECTIVE.format(
            body="rounds = 2 * (p - 1) if kind == 'all_reduce' else p - 1\nreturn alpha + rounds * beta * nbytes / p"),
        "the all-gather's n taken as each process's share": COLLECTIVE.format(
            body="per = nbytes if kind == 'all_gather' else nbytes / p\n"
                 "rounds = 2 * (p - 1) if kind == 'all_reduce' else p - 1\nreturn rounds * (alpha + beta * per)"),
        "calls the forbidden helper": COLLECTIVE.format(
            body="h = {'all_reduce': 2, 'reduce_scatter': 1, 'all_gather': 1}[kind]\n"
                 "return gc.ring_all_reduce_time(nbytes, p, alpha, beta) * h / 2"),
        "no check of the kind": """\
p = world_size
rounds = 2 * (p - 1) if kind == "all_reduce" else p - 1
return rounds * (alpha + beta * nbytes / p)
""",
    },
}

HIDDEN = {
    "05.1": {
        "machines capped at 8 processes (a DGX's 8 GPUs)": """\
table, rank = [], 0
for n in gpus_per_node:
    n = min(n, 8)                               # no machine has more than 8 GPUs
    table.append(list(range(rank, rank + n)))
    rank += n
return rank, table
""",
    },
    "05.2": {
        "a list or a range, not a list with ranges": SLURM_CHECK + """\
if "MASTER_ADDR" in environ:
    addr = environ["MASTER_ADDR"]
else:
    import re
    first = re.match(r"[^,\\[]+(\\[[^\\]]*\\])?", environ["SLURM_JOB_NODELIST"]).group(0)
    prefix, _, rest = first.partition("[")
    rest = rest.rstrip("]")
    addr = prefix + (rest.split("-")[0] if "-" in rest else rest.split(",")[0])
""" + SLURM_PORT + SLURM_TAIL,
    },
    "05.3": {
        "always launched on 2 ranks": DIAGNOSE.format(rank="err.rank", same_order=EVERY_EPOCH_SAME).replace(
            "gc.launch(program, world_size,", "gc.launch(program, 2,"),
    },
    "05.4": {
        "n bytes sent as float32 elements": [PING.format(**RIGHT_PING).replace(
            "torch.empty(n, dtype=torch.uint8)", "torch.empty(n // 4, dtype=torch.float32)"), None],
    },
    "05.5": {
        "the port zero-padded to 5 digits": ENV.format(**RIGHT_ENV).replace("str(master_port)", 'f"{master_port:05d}"'),
    },
    "05.6": {
        "a 32-bit byte count (overflows past 2 GiB)": COLLECTIVE.format(
            body="n = int(torch.tensor(nbytes, dtype=torch.int32))\n"
                 "rounds = 2 * (p - 1) if kind == 'all_reduce' else p - 1\nreturn rounds * (alpha + beta * n / p)"),
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("05", VISIBLE, HIDDEN)
