## Part of capture/nanreplay_capture.py: the ring buffer's slot.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# The ring buffer.

class _StepSlot:
    """One recorded step: host copies made at begin_step (none for a light record, whose
    parameters nanreplay derives), scalars added at end_step."""

    def __init__(self, params, pin, full=True):
        self.full = full
        self.params = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for p in params] if full else []
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

    def state_buffer(self, entry, i, like):
        buf = self.state_bufs.get((entry, i))
        if buf is None or buf.dtype != like.dtype or buf.shape != like.shape:
            buf = self.state_bufs[(entry, i)] = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                                                            pin_memory=self.pin)
        return buf
