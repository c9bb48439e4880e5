"""Chapter 04: plausible wrong answers its checks must reject (see ``_mutations.py``).

04.1 and 04.3 are mechanisms (asynchronous buckets, ``no_sync``): their wrong answers compute the
right numbers the wrong way (a blocking all-reduce, waiting during backward, sending after backward,
syncing every micro-batch, deciding at backward time), and the checks catch them from what the
check's run records — the all-reduce calls, when each was waited for, which storage each gradient
lives in — as values the judge compares with the course's answer.
"""

from _mutations import chapter_tests

# --- 04.1: three regions (__init__, grad_ready, wait) ----------------------------------------------

INIT = """\
self.world_size = dist.get_world_size()
params = [p for p in model.parameters() if p.requires_grad]
groups, current, size = [], [], 0
for p in reversed(params):
    nbytes = p.numel() * p.element_size()
    if current and size + nbytes > bucket_cap_bytes:
        groups.append(current)
        current, size = [], 0
    current.append(p)
    size += nbytes
if current:
    groups.append(current)
self.buckets, self.slot = [], {}
for b, group in enumerate(groups):
    flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype)
    offset = 0
    for p in group:
        view = flat[offset:offset + p.numel()].view_as(p)
        p.grad = view
        self.slot[p] = (b, view)
        offset += p.numel()
    self.buckets.append((group, flat))
self.ready = [0] * len(self.buckets)
self.launched = []
for p in params:
    p.register_post_accumulate_grad_hook(self.grad_ready)
"""

READY_COUNT = """\
b, view = self.slot[param]
if param.grad is not view:
    view.copy_(param.grad)
    param.grad = view
self.ready[b] += 1
group, flat = self.buckets[b]
"""

WAIT_DIVIDE = """\
for flat, work in self.launched:
    if work is not None:
        work.wait()
    flat /= self.world_size
self.launched, self.ready = [], [0] * len(self.buckets)
"""

VISIBLE = {
    "04.1": {
        # ported from test_visible_checks.py VISIBLE_WRONG["04.1"]: right values, no overlap
        "a blocking all-reduce per bucket": [None, READY_COUNT + """\
if self.ready[b] == len(group):
    dist.all_reduce(flat)
    self.launched.append((flat, None))
""", WAIT_DIVIDE],
        "async, but waited for at once": [None, READY_COUNT + """\
if self.ready[b] == len(group):
    work = dist.all_reduce(flat, async_op=True)
    work.wait()                                 # "to be safe": backward stops until it is back
    self.launched.append((flat, None))
""", WAIT_DIVIDE],
        "every bucket sent after backward": [None, READY_COUNT, """\
for group, flat in self.buckets:                # all at the end: nothing overlaps backward
    dist.all_reduce(flat, async_op=True).wait()
    flat /= self.world_size
self.ready = [0] * len(self.buckets)
"""],
        "copies into buckets, like MiniDDP": ["""\
self.world_size = dist.get_world_size()
params = [p for p in model.parameters() if p.requires_grad]
self.buckets, current, size = [], [], 0
for p in reversed(params):
    nbytes = p.numel() * p.element_size()
    if current and size + nbytes > bucket_cap_bytes:
        self.buckets.append(current)
        current, size = [], 0
    current.append(p)
    size += nbytes
if current:
    self.buckets.append(current)
self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
self.ready = [0] * len(self.buckets)
self.launched = []
for p in params:
    p.register_post_accumulate_grad_hook(self.grad_ready)
""", """\
b = self.bucket_of[id(param)]
self.ready[b] += 1
if self.ready[b] == len(self.buckets[b]):
    flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
    self.launched.append((b, flat, dist.all_reduce(flat, async_op=True)))
""", """\
for b, flat, work in self.launched:
    work.wait()
    flat /= self.world_size
    offset = 0
    for p in self.buckets[b]:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
self.launched, self.ready = [], [0] * len(self.buckets)
"""],
        "views never re-pointed after zero_grad": [None, """\
b, view = self.slot[param]                      # assumes param.grad is still the view
self.ready[b] += 1
group, flat = self.buckets[b]
if self.ready[b] == len(group):
    self.launched.append((flat, dist.all_reduce(flat, async_op=True)))
""", None],
        "a bucket closed when it reaches the cap": [INIT.replace("size + nbytes > bucket_cap_bytes",
                                                                 "size + nbytes >= bucket_cap_bytes"), None, None],
        "registration order, not backward order": [INIT.replace("in reversed(params)", "in params"), None, None],
        "sum, not average": [None, None, """\
for flat, work in self.launched:
    work.wait()
self.launched, self.ready = [], [0] * len(self.buckets)
"""],
        "counters never reset": [None, None, """\
for flat, work in self.launched:
    work.wait()
    flat /= self.world_size
self.launched = []
"""],
        # ported from test_hidden_checks.py WRONG_ANSWERS["04.1"]; visible since issue 38 (the text says: the
        # dtype of its parameters)
        "float32 buckets, whatever the gradients": [INIT.replace(
            "dtype=group[0].dtype", "dtype=torch.float32").replace(
            "view = flat[offset:offset + p.numel()].view_as(p)",
            "view = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)"), None, None],
    },
    "04.2": {
        "the all-reduce's schedule": """\
rank, p = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % p, (rank - 1) % p
chunks = [c.clone() for c in tensor.tensor_split(p)]
for s in range(p - 1):                          # lesson 10's reduce-scatter: ends with chunk r + 1
    send, arriving = chunks[(rank - s) % p], (rank - s - 1) % p
    buf = torch.empty_like(chunks[arriving])
    requests = [dist.isend(send, right), dist.irecv(buf, left)]
    for req in requests:
        req.wait()
    chunks[arriving] += buf
return chunks[rank]
""",
        "everything through rank 0": """\
rank, p = dist.get_rank(), dist.get_world_size()
if rank == 0:
    total = tensor.clone()
    for src in range(1, p):
        buf = torch.empty_like(tensor)
        dist.recv(buf, src)
        total += buf
    for dst, chunk in enumerate(total.tensor_split(p)):
        if dst > 0:
            dist.send(chunk.contiguous(), dst)
    return total.tensor_split(p)[0].clone()
dist.send(tensor, 0)
out = torch.empty_like(tensor.tensor_split(p)[rank])
dist.recv(out, 0)
return out
""",
        "in place, returning a view": """\
rank, p = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % p, (rank - 1) % p
chunks = tensor.tensor_split(p)                 # views: the input is overwritten
for s in range(p - 1):
    send, arriving = chunks[(rank - s - 1) % p], (rank - s - 2) % p
    buf = torch.empty_like(chunks[arriving])
    requests = [dist.isend(send, right), dist.irecv(buf, left)]
    for req in requests:
        req.wait()
    chunks[arriving].add_(buf)
return chunks[rank]
""",
        "torch.chunk instead of tensor_split": """\
rank, p = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % p, (rank - 1) % p
chunks = [c.clone() for c in tensor.chunk(p)]
chunks += [tensor[:0].clone()] * (p - len(chunks))
for s in range(p - 1):
    send, arriving = chunks[(rank - s - 1) % p], (rank - s - 2) % p
    buf = torch.empty_like(chunks[arriving])
    requests = [dist.isend(send, right), dist.irecv(buf, left)]
    for req in requests:
        req.wait()
    chunks[arriving] += buf
return chunks[rank]
""",
        "p steps, not p - 1": """\
rank, p = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % p, (rank - 1) % p
chunks = [c.clone() for c in tensor.tensor_split(p)]
for s in range(p):
    send, arriving = chunks[(rank - s) % p], (rank - s - 1) % p
    buf = torch.empty_like(chunks[arriving])
    requests = [dist.isend(send, right), dist.irecv(buf, left)]
    for req in requests:
        req.wait()
    chunks[arriving] += buf
return chunks[rank]
""",
        "a collective after all": """\
rank, p = dist.get_rank(), dist.get_world_size()
out = [c.clone() for c in tensor.tensor_split(p)]
dist.all_reduce(tensor.clone())
return out[rank]
""",
        "calls the forbidden helper": """\
return gc.reduce_scatter(tensor)
""",
    },
    "04.3": {
        # ported from test_visible_checks.py VISIBLE_WRONG["04.3"]: the right gradients, k times the traffic
        "syncs every micro-batch": [None, None, """\
dist.all_reduce(param.grad)                     # ignores no_sync
param.grad /= self.world_size
""", None],
        "decides at backward time": [None, """\
return self.module(*args, **kwargs)
""", """\
if self.require_sync:                           # the state now, not at forward time
    dist.all_reduce(param.grad)
    param.grad /= self.world_size
""", None],
        "sum, not average": [None, None, """\
if self.sync_this_backward:
    dist.all_reduce(param.grad)
""", None],
        # a data-dependent skip: rank 0's all-zero gradient is not all-reduced, the others' are (passed before)
        "skips an all-zero gradient": [None, None, """\
if self.sync_this_backward and param.grad.abs().sum() > 0:   # skip empty gradients
    dist.all_reduce(param.grad)
    param.grad /= self.world_size
""", None],
        "no_sync never switched off": [None, None, None, """\
yield
"""],
        # was hidden-only; the text names both (issue 38: edge ideas belong in the visible cases)
        "no try/finally, no restore": [None, None, None, """\
self.require_sync = False                       # an exception leaves it off,
yield                                           # and a nested block switches it back on too early
self.require_sync = True
"""],
    },
    "04.4": {
        "constant": ["return 0.0", "return caps[0]"],
        # ported from test_visible_checks.py VISIBLE_WRONG["04.4"]
        "a bucket closed when it reaches the cap": ["""\
buckets, size, last = [], 0, None
for t, n in zip(ready, nbytes):
    if last is not None and size + n >= bucket_cap:
        buckets.append((size, last))
        size = 0
    size, last = size + n, t
buckets.append((size, last))
link_free = 0.0
for size, ready_at in buckets:
    link_free = max(link_free, ready_at) + alpha + beta * size
return link_free
""", None],
        "every bucket on its own link": ["""\
buckets, size, last = [], 0, None
for t, n in zip(ready, nbytes):
    if last is not None and size + n > bucket_cap:
        buckets.append((size, last))
        size = 0
    size, last = size + n, t
buckets.append((size, last))
return max(ready_at + alpha + beta * size for size, ready_at in buckets)   # no queue on the link
""", None],
        "no overlap": ["""\
buckets, size = [], 0
for n in nbytes:
    if size and size + n > bucket_cap:
        buckets.append(size)
        size = 0
    size += n
buckets.append(size)
return ready[-1] + sum(alpha + beta * s for s in buckets)        # all after backward
""", None],
        "latency paid once": ["""\
buckets, size, last = [], 0, None
for t, n in zip(ready, nbytes):
    if last is not None and size + n > bucket_cap:
        buckets.append((size, last))
        size = 0
    size, last = size + n, t
buckets.append((size, last))
link_free = alpha
for size, ready_at in buckets:
    link_free = max(link_free, ready_at) + beta * size
return link_free
""", None],
        "the largest cap on a tie": [None, """\
times = [modelled_step_time(ready, nbytes, alpha, beta, cap) for cap in caps]
return max((c for c, t in zip(caps, times) if t == min(times)))
"""],
        # ported from test_hidden_checks.py WRONG_ANSWERS["04.4"]; visible since issue 38 (the text names the tie rule)
        "first in list order on a tie": [None, """\
return min(caps, key=lambda cap: modelled_step_time(ready, nbytes, alpha, beta, cap))
"""],
    },
    "04.5": {
        "a sum, not a mean": """\
buffer = bucket.buffer()
return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
""",
        "no all-reduce: each rank keeps its own gradients": """\
fut = torch.futures.Future()
fut.set_result(bucket.buffer() / dist.get_world_size())
return fut
""",
        "the future of the list, not of the tensor": """\
buffer = bucket.buffer()
buffer.div_(dist.get_world_size())
return dist.all_reduce(buffer, async_op=True).get_future()
""",
        "returns the buffer before the all-reduce changed it": """\
before = bucket.buffer() / dist.get_world_size()
dist.all_reduce(bucket.buffer())
fut = torch.futures.Future()
fut.set_result(before)
return fut
""",
        "PyTorch's hook": """\
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
return allreduce_hook(None, bucket)
""",
        # issue 38: right gradients, no overlap — both passed the visible and the hidden check before
        "a blocking all-reduce, a completed future": """\
buffer = bucket.buffer()
buffer.div_(dist.get_world_size())
dist.all_reduce(buffer)                          # no async_op: the hook waits for every rank
fut = torch.futures.Future()
fut.set_result(buffer)
return fut
""",
        "async, but waited for inside the hook": """\
buffer = bucket.buffer()
buffer.div_(dist.get_world_size())
work = dist.all_reduce(buffer, async_op=True)
work.wait()                                      # 'to be sure it is done before DDP reads it'
return work.get_future().then(lambda fut: fut.value()[0])
""",
        "the future waited for before it is returned": """\
buffer = bucket.buffer()
buffer.div_(dist.get_world_size())
fut = dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
fut.wait()
return fut
""",
        # the notebook starts 2 live ranks: passed the visible and the hidden check while every case ran on them
        "divides by 2, the notebook's number of ranks": """\
buffer = bucket.buffer()
buffer.div_(2)                                   # two GPUs
return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
""",
    },
}

HIDDEN = {
    "04.1": {
        # an empty first bucket when the very first gradient is larger than the cap (cap 8 bytes)
        "no check for an empty bucket": [INIT.replace(
            "if current and size + nbytes > bucket_cap_bytes", "if size + nbytes > bucket_cap_bytes"), None, None],
    },
    "04.2": {
        # ported from test_hidden_checks.py WRONG_ANSWERS["04.2"]: the check's dtype, hard-coded
        "a float64 buffer": """\
rank, p = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % p, (rank - 1) % p
chunks = [c.clone() for c in tensor.tensor_split(p)]
for s in range(p - 1):
    send, arriving = chunks[(rank - s - 1) % p], (rank - s - 2) % p
    buf = torch.empty(chunks[arriving].shape, dtype=torch.float64)
    requests = [dist.isend(send, right), dist.irecv(buf, left)]
    for req in requests:
        req.wait()
    chunks[arriving] += buf
return chunks[rank]
""",
    },
    "04.3": {
        "hooks only on the Linear layers' parameters": ["""\
super().__init__()
self.module = module
self.world_size = dist.get_world_size()
self.require_sync = True
self.sync_this_backward = True
for layer in module.modules():
    if isinstance(layer, nn.Linear):             # a LayerNorm's or a bare nn.Parameter's gradient is never averaged
        for param in layer.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self.average)
""", None, None, None],
    },
    "04.4": {
        "caps larger than the whole model dropped": [None, """\
caps = [cap for cap in caps if cap <= sum(nbytes)]   # 'such a cap is one bucket anyway' - and none may be left
return min(sorted(caps), key=lambda cap: modelled_step_time(ready, nbytes, alpha, beta, cap))
"""],
    },
    "04.5": {
        "float32 whatever the gradients": """\
buffer = bucket.buffer()
buffer.div_(dist.get_world_size())
return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0].float())
""",
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("04", VISIBLE, HIDDEN)
