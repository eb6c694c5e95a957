## Part of capture/nanreplay_capture.py: the ring buffer's slot.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# The ring buffer.

class _StepSlot:
    """One recorded step: host copies made at begin_step (none for a light record, whose
    parameters nanreplay derives), scalars added at end_step."""

    def __init__(self, params, pin, full=True, experts=((), {})):
        self.full = full
        groups, self.views = experts  # fused expert tensors; {parameter index: (group, expert, columns)}
        self.fused = [torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=pin) for g in groups] if full else []
        self.fused_moments = {"exp_avg": [None] * len(groups), "exp_avg_sq": [None] * len(groups)}
        self.params = [expert_view(self.fused[self.views[i][0]], *self.views[i][1:]) if i in self.views else
                       torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                       for i, p in enumerate(params)] if full else []
        self.exp_avg = [None] * len(self.params)      # host buffers, allocated on first AdamW state
        self.exp_avg_sq = [None] * len(self.params)
        self.state_bufs = {}                          # (entry, i): host buffer, for classes beyond AdamW
        self.pin = pin
        self._steps = None
        self.reset()

    def reset(self):
        self.step = None
        self.has_moments = [False] * len(self.params)
        self.entries = [[] for _ in self.params]   # per parameter: the state entries copied (beyond AdamW)
        self.adam_steps = []       # AdamW's per-parameter "step" values held on the host
        self.device_steps = None   # ... and those copied from CUDA tensors (capturable/fused AdamW)
        self.lr = None
        self.loss_scale = None
        self.sampler = None
        self.rows = None       # per rank: token offset of each row's window, in read order
        self.rows_are_samples = True
        self.logged = {}
        self.skipped = None
        self.ended = False
        self.event = None

    def step_buffer(self, n):
        if self._steps is None or self._steps.numel() < n:
            self._steps = torch.empty(n, dtype=torch.float64, pin_memory=self.pin)
        return self._steps[:n]

    def moment_buffer(self, which, i, like):
        bufs = self.exp_avg if which == "exp_avg" else self.exp_avg_sq
        if bufs[i] is None or bufs[i].dtype != like.dtype or bufs[i].shape != like.shape:
            bufs[i] = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
        return bufs[i]

    def expert_moment(self, which, i, whole):
        """The host buffer of a fused expert tensor's moment `whole` (allocated on first AdamW state), with
        parameter i's part of it set as a view (the moment splits as the parameter does)."""
        g, e, columns = self.views[i]
        bufs = self.fused_moments[which]
        if bufs[g] is None or bufs[g].dtype != whole.dtype or bufs[g].shape != whole.shape:
            bufs[g] = torch.empty(whole.shape, dtype=whole.dtype, device="cpu", pin_memory=self.pin)
        (self.exp_avg if which == "exp_avg" else self.exp_avg_sq)[i] = expert_view(bufs[g], e, columns)
        return bufs[g]

    def state_buffer(self, entry, i, like):
        buf = self.state_bufs.get((entry, i))
        if buf is None or buf.dtype != like.dtype or buf.shape != like.shape:
            buf = self.state_bufs[(entry, i)] = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                                                            pin_memory=self.pin)
        return buf
