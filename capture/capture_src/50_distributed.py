## Part of capture/nanreplay_capture.py: distributed jobs (DDP, FSDP, torch.compile): unwrapping, collectives, gathering shards.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# Distributed jobs (DDP, FSDP, torch.compile): unwrapping, the collectives every rank calls, the
# per-rank gradient norms before the all-reduce, and gathering sharded state onto the recording rank.

def _is_fsdp1(module):
    """FullyShardedDataParallel (FSDP1), found by class name so that no FSDP import is needed
    (torch 1.13's FSDP package does not even import on Python 3.11)."""
    return any(c.__name__ == "FullyShardedDataParallel" for c in type(module).__mro__)


def _is_sharded(module):
    """FSDP1, or FSDP2's fully_shard (its parameters are DTensors)."""
    if _is_fsdp1(module):
        return True
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


def unwrap_model(model):
    """The module a training wrapper holds: DistributedDataParallel's / DataParallel's `.module`
    (or any wrapper whose only child is `module` and that owns no parameters, e.g. DeepSpeed's
    engine), torch.compile's `_orig_mod`, repeatedly. FSDP is returned as it is: its parameters
    are shards, which the recorder gathers instead."""
    for _ in range(16):
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, torch.nn.Module) and not _is_fsdp1(model) and (
                isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
                or (not any(p is not None for p in model._parameters.values())
                    and [n for n, _ in model.named_children()] == ["module"])):
            model = inner
            continue
        return model
    return model


# Prefixes wrappers put into parameter names; a sharded model's full state is keyed without them.
_WRAPPER_PREFIX = re.compile(r"(?:_fsdp_wrapped_module|_fpw_module|_checkpoint_wrapped_module|_orig_mod|module)\.")


def _clean_name(name):
    return _WRAPPER_PREFIX.sub("", name) if _WRAPPER_PREFIX.search(name) else name


class _Collective:
    """The few collectives the recorder makes when torch.distributed runs with more than one rank.
    Every rank calls each one in the same order (begin_step, end_step, dump are called by every rank)."""

    def __init__(self, record_rank, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if not 0 <= int(record_rank) < self.world:
            raise CaptureError(f"record_rank {record_rank} is not a rank of this {self.world}-rank job")
        self.record_rank = int(record_rank)
        nccl = str(dist.get_backend(group)).lower() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def recording(self):
        return self.rank == self.record_rank

    def gather_objects(self, obj):
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_floats(self, values):
        """[values of rank 0, values of rank 1, ...]: one all_gather of a few float64."""
        mine = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64,
                            device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self.dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.record_rank, group=self.group)
        return box[0]

    def agree(self, fn):
        """Runs fn() on the recording rank and hands its result, or its error, to every rank: a
        failure there raises on every rank instead of leaving the others waiting."""
        outcome, error = None, None
        if self.recording:
            try:
                outcome = ("ok", fn())
            except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
                outcome, error = ("error", f"{type(e).__name__}: {e}"), e
        kind, value = self.broadcast(outcome)
        if kind == "error":
            if error is not None:
                raise error
            raise CaptureError(f"the recording rank {self.record_rank} failed: {value}")
        return value


class _RankGradNorm:
    """This rank's own gradient norm before the all-reduce, from the gradients a comm hook sees: the
    2-norm over every DDP bucket (or FSDP flat parameter) of one step. Each bucket must be reduced
    once per step, which is what DDP's no_sync() does with gradient accumulation; a bucket reduced
    twice in a step (accumulation without no_sync) leaves the step without rank norms."""

    def __init__(self):
        self.limit = None  # FSDP: at most this many reductions (one per FSDP unit) in a step
        self.reset()

    def reset(self):
        self.sq, self.fires = None, collections.Counter()

    def record(self, key, grad):
        sq = torch.linalg.vector_norm(grad.detach(), 2, dtype=torch.float64).square()
        self.sq = sq if self.sq is None else self.sq + sq
        self.fires[key] += 1

    def value(self, loss_scale=None):
        """(norm, valid): the norm divided by the loss scale (GradScaler scales the gradients)."""
        if self.sq is None:
            return math.nan, False
        norm = math.sqrt(float(self.sq))
        if loss_scale:
            norm /= float(loss_scale)
        calls = sum(self.fires.values())
        return norm, max(self.fires.values()) == 1 and (self.limit is None or calls <= self.limit)


def _ddp_norm_hook(norms, inner):
    def nanreplay_rank_norm_hook(state, bucket):
        norms.record(bucket.index(), bucket.buffer())  # before the hook divides and all-reduces it in place
        return inner(state, bucket)
    return nanreplay_rank_norm_hook


def _fsdp_norm_hook(norms, inner):
    def nanreplay_rank_norm_hook(state, grad, output=None):
        norms.record(len(norms.fires), grad)  # the unsharded gradient of one flat parameter, before reducing
        return inner(state, grad) if output is None else inner(state, grad, output)
    return nanreplay_rank_norm_hook


def _registered_ddp_comm_hook(ddp):
    """The name of the comm hook a DDP model already has, or None. DDP takes one hook per model and
    a second registration fails inside its reducer, so this is asked first: torch >= 2.1 lists the
    hooks in `_comm_hooks`; torch 1.13 keeps them in C++ and only gives its logger the hook's name."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        hook = hooks[0][0] if isinstance(hooks[0], tuple) else hooks[0]
        return getattr(hook, "__qualname__", repr(hook))
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except (AttributeError, RuntimeError):
        return None
    return str(name) if name else None


def _install_norm_hook(wrapper, norms, comm_hook, comm_hook_state):
    """Registers the comm hook that measures this rank's norm (wrapping `comm_hook`, default: the
    plain all-reduce / reduce-scatter the wrapper does without one). Returns a word for what it did."""
    if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        existing = _registered_ddp_comm_hook(wrapper)
        if existing is not None:
            raise CaptureError(
                f"the DistributedDataParallel model already has a comm hook ({existing}), and DDP takes one "
                "hook per model, so the recorder cannot add the one that measures each rank's gradient norm. "
                "Give your hook to the recorder instead of registering it: drop "
                "ddp.register_comm_hook(state, hook) and pass Recorder(..., comm_hook=hook, "
                "comm_hook_state=state), which wraps it (your hook still reduces the gradients); a built-in "
                "hook (register_builtin_comm_hook) has a Python equivalent in "
                "torch.distributed.algorithms.ddp_comm_hooks.default_hooks to pass the same way. Or pass "
                "comm_hook=False to record no per-rank gradient norms")
        inner = default_hooks.allreduce_hook if comm_hook in (None, True) else comm_hook
        wrapper.register_comm_hook(comm_hook_state, _ddp_norm_hook(norms, inner))
        return "ddp"
    if _is_fsdp1(wrapper) and hasattr(wrapper, "register_comm_hook"):  # FSDP1, torch >= 2.0
        from torch.distributed.algorithms._comm_hooks import default_hooks
        state = comm_hook_state if comm_hook_state is not None else default_hooks.DefaultState(
            wrapper.process_group)

        def default(state, grad, output=None):
            if output is None:
                return default_hooks.allreduce_hook(state, grad)
            return default_hooks.reduce_scatter_hook(state, grad, output)
        wrapper.register_comm_hook(state, _fsdp_norm_hook(norms, default if comm_hook in (None, True) else comm_hook))
        norms.limit = sum(1 for m in wrapper.modules() if _is_fsdp1(m))  # a unit reduced twice: no no_sync()
        return "fsdp"
    return None


class _ShardedGather:
    """Full parameters and AdamW state of a sharded model (FSDP1 FullyShardedDataParallel, FSDP2
    fully_shard), gathered onto the recording rank. Every rank calls gather() (it is collective);
    the recording rank gets ({name: CPU tensor}, {name: {"exp_avg", "exp_avg_sq", "step"}}), the
    others None. Names are the model's own, without wrapper prefixes."""

    def __init__(self, wrapper, optimizer, collective):
        self.wrapper, self.optimizer, self.coll = wrapper, optimizer, collective
        self.buffers = {_clean_name(n) for n, _ in wrapper.named_buffers()}

    @property
    def recording(self):
        return self.coll is None or self.coll.recording

    def gather(self, optimizer=True):
        if _is_fsdp1(self.wrapper):
            params, state = self._gather_fsdp1(optimizer)
        else:
            params, state = self._gather_dtensors(optimizer)
        if not self.recording:
            return None
        params = {_clean_name(k): v for k, v in params.items() if _clean_name(k) not in self.buffers}
        state = {_clean_name(str(k)): v for k, v in (state or {}).items()}
        return params, state

    def _gather_fsdp1(self, optimizer):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        # rank0_only hands the state to rank 0 alone; any other recording rank needs it on every rank.
        rank0_only = self.coll is None or self.coll.record_rank == 0
        # offload_to_cpu moves the gathered state off the compute device. On a CPU device it frees the very
        # storage it "moved" (torch 2.6: "setStorage: ... out of bounds for storage of size 0"): no offload there.
        device = getattr(self.wrapper, "compute_device", None)
        offload = device is None or torch.device(device).type != "cpu"
        cfg = FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
        with FSDP.state_dict_type(self.wrapper, StateDictType.FULL_STATE_DICT, cfg):
            params = self.wrapper.state_dict()
        if not optimizer:
            return params, None
        if hasattr(FSDP, "optim_state_dict"):  # torch >= 2.0: keyed by parameter names
            from torch.distributed.fsdp import FullOptimStateDictConfig
            with FSDP.state_dict_type(self.wrapper, StateDictType.FULL_STATE_DICT, cfg,
                                      FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)):
                osd = FSDP.optim_state_dict(self.wrapper, self.optimizer)
        else:  # torch 1.13: keyed by ids, rekeyed to names
            from torch.distributed.fsdp import OptimStateKeyType
            osd = FSDP.full_optim_state_dict(self.wrapper, self.optimizer, rank0_only=rank0_only)
            if osd:
                osd = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, self.wrapper)
        return params, (osd or {}).get("state", {})

    def _gather_dtensors(self, optimizer):
        """fully_shard: every parameter and moment is a DTensor; full_tensor() all-gathers it."""
        def full(t):
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            return t.detach().to("cpu") if self.recording else None
        params, state = {}, {}
        for name, p in self.wrapper.named_parameters():
            params[name] = full(p)
            st = self.optimizer.state.get(p) if optimizer else None
            if st and "exp_avg" in st:
                step = st.get("step", 0)
                step = step.full_tensor() if hasattr(step, "full_tensor") else step
                state[name] = {"exp_avg": full(st["exp_avg"]), "exp_avg_sq": full(st["exp_avg_sq"]),
                               "step": float(step)}
        return params, state


class _MetaTemplate(torch.Tensor):
    """A full parameter's shape and dtype (a meta tensor: no memory); not a live parameter, so the
    recorder's checks read the snapshot's host copies instead."""


class _GatheredModel:
    """What the constructor reads names, shapes and dtypes from for a sharded model: the full
    parameters as meta tensors (no memory), with the original module's config and norm modules."""

    def __init__(self, module, shapes):
        self._module = module
        self._parameters = {}
        for name, (shape, dtype, alias) in shapes.items():
            self._parameters[name] = (self._parameters[alias] if alias else
                                      torch.empty(shape, dtype=dtype, device="meta").as_subclass(_MetaTemplate))
        for attr in ("config", "rope_theta"):
            if getattr(module, attr, None) is not None:
                setattr(self, attr, getattr(module, attr))

    def named_modules(self, remove_duplicate=True):
        yield "", self

    def get_submodule(self, name):
        module = self._module
        for part in name.split("."):
            for _ in range(4):  # wrapper modules FSDP and activation checkpointing insert
                if hasattr(module, part) or not hasattr(module, "_fsdp_wrapped_module") and \
                        not hasattr(module, "_checkpoint_wrapped_module") and not hasattr(module, "_fpw_module"):
                    break
                module = getattr(module, "_fsdp_wrapped_module", None) or getattr(
                    module, "_fpw_module", None) or getattr(module, "_checkpoint_wrapped_module")
            module = getattr(module, part, None)
            if module is None:
                raise AttributeError(name)
        return module


def _gathered_shapes(params):
    """{name: (shape, dtype, alias)}: a tensor equal to an earlier one of the same shape is taken as
    tied to it (a full state dict returns tied weights as two entries)."""
    out, seen = {}, []
    for name, t in params.items():
        alias = next((n for n, u in seen if u.shape == t.shape and u.dtype == t.dtype and
                      (u.data_ptr() == t.data_ptr() or torch.equal(u, t))), None)
        out[name] = (tuple(t.shape), t.dtype, alias)
        if alias is None:
            seen.append((name, t))
    return out


