## Part of capture/nanreplay_capture.py: Recorder, the API a training loop calls.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
class Recorder(_OptimizerByName):
    """Keeps the last `window` training steps and writes them as a nanreplay bundle.

    On the first step it captures with a finite loss, end_step() proves the bundle: the bundle's
    model computes that step's loss on its batch and must match the logged loss (CaptureError
    naming the likely cause otherwise; `recorder.self_check = False` skips it; the outcome is
    `recorder.self_check_result`).

    Per step, in the training loop:
        recorder.begin_step(step, samples=batch_indices)   # before forward: snapshots params + AdamW
        ... forward, backward, clip_grad_norm_ ...
        recorder.end_step(loss=loss, grad_norm=norm)       # dumps the window when loss is non-finite
        optimizer.step(); scheduler.step()

    Arguments:
      model, optimizer: the module being trained and its torch.optim.AdamW (or another class the replay
        follows, known by class name), or a list of the run's optimizers when it has several (a Muon
        run: [torch.optim.Muon over the hidden matrices, AdamW over the rest]); every parameter in
        exactly one of them. A DDP / DataParallel / torch.compile wrapper is unwrapped; an FSDP model
        is gathered onto the recording rank at each full snapshot (needs snapshot_every).
      out_dir: where automatic dumps go (`<out_dir>/incident-step<step>`).
      arch: "llama" or "gpt2" (bundle v1 architectures).
      model_config: manifest model keys; shapes are read off the parameters; `num_heads`, `norm_eps`
        and `rope_theta` are read off the model (its norm modules, model.config, model.params, ...)
        where it says them, else `num_heads` is required and the others take bundle v1's defaults
        (1e-5, 10000), which the self-check on the first captured step then proves. llama's
        options (rope_style, rope_scaling, attention_bias, qk_norm, attn_logit_softcap,
        final_logit_softcap, sliding_window) are read off a Hugging Face style `model.config`
        where it says them, else taken from here (default: off); the two must agree. So is llama's
        `moe` (Hugging Face Qwen3-MoE's mlp.gate + mlp.experts.{e}.{gate,up,down}_proj in every layer):
        model_config=dict(moe=dict(num_experts, top_k, norm_topk_prob=False, router_aux_loss_coef=0,
        router_z_loss_coef=0)), or read off an HF MoE config (num_experts / num_local_experts,
        num_experts_per_tok, moe_intermediate_size, norm_topk_prob, router_aux_loss_coef when
        output_router_logits); the experts' count and width are read off the parameters. GPT-OSS's and
        Llama 4's models (model.config.model_type "gpt_oss", "llama4_text", "llama4") are read with their
        fused experts, split per expert as `nanreplay import` splits them (docs/capture.md, "Fused experts").
      data: dict(shards=[paths or dicts(path, dtype, header_bytes)], token_dtype="uint16",
        header_bytes=0, seq_len, micro_batch_size, grad_accum_steps=1, world_size=1,
        sampler=None or dict(kind="randperm", seed, epoch=0, epoch_start_step=0)).
      window: steps kept (the bundle holds at most this many).
      snapshot_every: instead of a ring of `window` full steps, a full snapshot every K steps (the
        last two kept) and a light record of every step since the older one; the bundle then rolls
        forward from that snapshot (K + 1 to 2K steps). Host memory: two snapshots.
      precision: "fp32", "bf16" (autocast), "fp16" (autocast + GradScaler) or "fp8".
      grad_clip: the max_norm given to clip_grad_norm_, or None.
      param_names: dict or callable mapping the model's parameter names to the bundle's keys
        (docs/bundle-format.md), or a preset: "hf", "meta" / "torchtitan" (implies rope_style
        "interleaved"), "nanogpt" (docs/import.md); wrapper prefixes (_orig_mod., module.) are dropped.
      data_copy: "auto", "whole" or "window" (see dump()).
      whole_copy_limit: bytes of shard data up to which "auto" copies shards whole.
      pin_memory: host buffers pinned for asynchronous copies (default: when params are on CUDA).
      distributed: None (default): collective when torch.distributed runs more than one rank; then
        every rank creates the recorder and calls begin_step / end_step / dump, rank `record_rank`
        keeps the window and writes, and the recorder gathers samples, per-rank losses and norms.
        False: this process alone (a rank-0-only recorder fed every rank's values).
      record_rank: the rank that records and writes (default 0).
      comm_hook, comm_hook_state: True (default) installs a DDP / FSDP comm hook measuring each rank's
        gradient norm before the all-reduce, around the default all-reduce; a hook of yours to wrap
        instead; False for none.
    """

    self_check = True          # end_step() proves the bundle's model on the first finite step
    self_check_result = None   # {step, logged, reference, relative, tolerance} once it passed

    def __init__(self, model, optimizer, out_dir, *, arch, data, model_config=None, window=DEFAULT_WINDOW,
                 precision="fp32", grad_clip=None, param_names=None, data_copy="auto",
                 whole_copy_limit=DEFAULT_WHOLE_COPY_LIMIT, pin_memory=None, snapshot_every=None,
                 distributed=None, record_rank=0, comm_hook=True, comm_hook_state=None):
        if window < 1:
            raise CaptureError("window must be at least 1")
        if snapshot_every is not None and int(snapshot_every) < 1:
            raise CaptureError("snapshot_every must be at least 1 (or None for the ring of full steps)")
        self.snapshot_every = None if snapshot_every is None else int(snapshot_every)
        if precision not in _PRECISIONS:
            raise CaptureError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if data_copy not in ("auto", "whole", "window"):
            raise CaptureError(f"data_copy must be 'auto', 'whole' or 'window', got {data_copy!r}")
        # Several optimizers (a Muon run's Muon and AdamW): the first is the manifest's top level.
        self.optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if not self.optimizers:
            raise CaptureError("optimizer: an empty list (give the run's optimizer, or its optimizers)")
        optimizer = self.optimizers[0]
        model = self._setup_distributed(model, optimizer, distributed, record_rank)  # unwraps DDP, compile, FSDP
        if self._sharded is not None and len(self.optimizers) > 1:
            raise CaptureError("under FSDP the recorder gathers one torch.optim.AdamW's state; got "
                               f"{len(self.optimizers)} optimizers")
        self.model, self.optimizer = model, optimizer
        self.out_dir = Path(out_dir)
        self.window, self.precision, self.grad_clip = int(window), precision, grad_clip
        self.data_copy, self.whole_copy_limit = data_copy, int(whole_copy_limit)
        self.data = self._check_data(data)
        if self._coll is not None:  # data.world_size is the job's
            if dict(data).get("world_size") is None:
                self.data["world_size"] = self._coll.world
            elif int(self.data["world_size"]) != self._coll.world:
                raise CaptureError(f"data world_size {self.data['world_size']} but torch.distributed runs "
                                   f"{self._coll.world} ranks")
        self.source = _TokenSource(self.data)
        self.sampler = dict(self.data["sampler"]) if self.data.get("sampler") else None

        rename, model_config = _renamer(param_names, arch, model_config)
        named = {}
        for name, p in _all_named_parameters(model):
            named.setdefault(rename(name), p)
        named, self._fused = _split_fused(named, model, model_config or {})
        named, self._experts = _split_experts(named, model)  # GPT-OSS's, Llama 4's fused experts
        if (self._fused or self._experts) and self._sharded is not None:
            fused = next(iter(self._fused.values()), None) or next(iter(self._experts.values()))
            raise CaptureError(f"{fused[0]} is fused: under FSDP the recorder gathers whole parameters by name and "
                               "does not split them (nor their sharded AdamW moments); save a checkpoint and run "
                               "`nanreplay import` on it (docs/import.md)")
        self.defaulted = {}  # what bundle v1's defaults filled in: the manifest's provenance says so
        self.model_config = _infer_model_config(arch, model, named, model_config or {}, self.data["seq_len"],
                                                self.defaulted)
        spec = family_parameters(expected_parameters(arch, self.model_config), self.model_config)
        self.names = [name for name, _ in spec]
        self.params = []
        for name, shape in spec:
            p = named.get(name)
            if p is None:
                raise CaptureError(f"the model has no parameter {name!r} (bundle v1, {arch}"
                                   f"{_option_needing(name, self.model_config)})")
            if tuple(p.shape) != tuple(shape):
                raise CaptureError(f"{name} has shape {tuple(p.shape)}, bundle v1 expects {tuple(shape)}"
                                   f"{_option_needing(name, self.model_config)}")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise CaptureError(f"{name} is {p.dtype}; bundle v1 stores F32, BF16 or F16")
            self.params.append(p)
        # What the optimizer holds for each bundle parameter: itself, or the fused parameter it is rows (or an
        # expert's part) of.
        self._held = [self._fused[n][1] if n in self._fused else self._experts[n][1] if n in self._experts else p
                      for n, p in zip(self.names, self.params)]
        self._expert_groups, self._expert_of = _expert_layout(self.names, self._experts)
        wanted = {id(p) for p in self.params}
        extra = sorted({n for n, p in named.items() if id(p) not in wanted})
        if extra:
            raise CaptureError(f"parameters outside bundle v1's {arch} model: {extra[:6]}"
                               + (f" and {len(extra) - 6} more" if len(extra) > 6 else ""))
        self._check_optimizer()
        self._optimizer_manifest()  # what the manifest cannot say is refused now, not while an incident is written

        self._async = any(p.is_cuda for p in self.params)
        self._pin = (self._async and torch.cuda.is_available()) if pin_memory is None else bool(pin_memory)
        self._free = []                                  # full slots evicted from the ring, reused
        self._ring = collections.deque()                 # slots in step order, oldest first
        self._copying = None                             # the full slot whose copies may be in flight
        self._copy_stream = None
        for opt in self.optimizers:
            if self._async and hasattr(opt, "register_step_pre_hook"):
                opt.register_step_pre_hook(self._order_update_after_copies)
        self.incident_path = None
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._norms, self._norms_from, self._norms_warned = None, None, False
        if self._coll is not None and comm_hook is not False:
            self._norms = _RankGradNorm()
            self._norms_from = _install_norm_hook(self.wrapper, self._norms, comm_hook, comm_hook_state)
            if self._norms_from is None:
                self._norms = None

    # -- distributed setup ----------------------------------------------------

    def _setup_distributed(self, model, optimizer, distributed, record_rank):
        """Unwraps `model` (DDP, DataParallel, torch.compile); decides whether this recorder runs
        collectively (torch.distributed initialised with more than one rank, unless distributed=False);
        for a sharded model gathers the full parameters once to learn their names and shapes. Returns
        what the constructor reads names, shapes and config from."""
        self._loss_scale, self._shadow, self._gathered, self._sharded = None, (None, None), None, None
        import torch.distributed as dist
        running = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed is None:
            distributed = running
        elif distributed and not running:
            raise CaptureError("distributed=True needs torch.distributed initialised with more than one rank")
        self._coll = _Collective(record_rank) if distributed else None
        inner = unwrap_model(model)
        ddp = model
        while not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp is not inner:
            ddp = getattr(ddp, "_orig_mod", None) or getattr(ddp, "module", None)
            if not isinstance(ddp, torch.nn.Module):
                break
        self.wrapper = ddp if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else inner
        if not _is_sharded(inner):
            return inner
        if self.snapshot_every is None:
            raise CaptureError("a sharded (FSDP) model is gathered onto the recording rank at each full snapshot: "
                               "pass snapshot_every=K so that happens once every K steps, not every step")
        self._sharded = _ShardedGather(inner, optimizer, self._coll)
        full = self._sharded.gather(optimizer=False)
        shapes = _gathered_shapes(full[0]) if full is not None else None
        if self._coll is not None:
            shapes = self._coll.broadcast(shapes)
        self._sharded_names = {id(p): _clean_name(n) for n, p in inner.named_parameters()}
        return _GatheredModel(inner, shapes)

    @property
    def is_recording(self):
        """Whether this process keeps the window and writes bundles (rank record_rank; always, in one process)."""
        return self._coll is None or self._coll.recording

    @property
    def rank(self):
        return 0 if self._coll is None else self._coll.rank

    # -- setup checks -------------------------------------------------------

    @staticmethod
    def _check_data(data):
        data = dict(data)
        for key in ("shards", "seq_len", "micro_batch_size"):
            if key not in data:
                raise CaptureError(f"data needs {key!r}")
        data.setdefault("grad_accum_steps", 1)
        data.setdefault("world_size", 1)
        sampler = data.get("sampler")
        if sampler is not None:
            if sampler.get("kind", "randperm") != "randperm" or "seed" not in sampler:
                raise CaptureError("data.sampler must be dict(kind='randperm', seed=..., epoch=0, "
                                   "epoch_start_step=0) or None (explicit samples per step)")
            data["sampler"] = {"kind": "randperm", "seed": int(sampler["seed"]),
                               "epoch": int(sampler.get("epoch", 0)),
                               "epoch_start_step": int(sampler.get("epoch_start_step", 0))}
        return data

    # -- the per-step hot path ------------------------------------------------

    @property
    def host_bytes_bound(self):
        """The most host memory the recorder can hold: window (or, with snapshot_every, two) times
        params + two AdamW moments."""
        moments = sum(2 * p.numel() * p.element_size() for p in self.params)  # AdamW keeps the param dtype
        full_steps = self.window if self.snapshot_every is None else 2
        return full_steps * (self.param_bytes + moments)

    def set_epoch(self, epoch, epoch_start_step):
        """Tell the recorder the randperm sampler moved to a new epoch (as DistributedSampler.set_epoch)."""
        if self.sampler is None:
            raise CaptureError("no randperm sampler was given in data.sampler")
        self.sampler = dict(self.sampler, epoch=int(epoch), epoch_start_step=int(epoch_start_step))

    def begin_step(self, step, *, samples=None, offsets=None, lr=None, loss_scale=None):
        """Snapshot the parameters and AdamW state at the start of `step` (call before forward).

        samples: dataset indices the step reads, per rank in read order ([[...], ...]; a flat list when
          world_size is 1); sample i is tokens [i*seq_len, i*seq_len + seq_len + 1) of the stream.
          Distributed (every rank calls begin_step): this rank's own indices, a flat list; the
          recorder gathers every rank's onto the recording rank.
        offsets: instead of samples, the first token (in the concatenated stream) of each row's
          seq_len + 1 window, for loaders that read at arbitrary offsets (e.g. nanoGPT's get_batch).
        Neither: derived from data.sampler (randperm).
        lr: the step's learning rate (default: the optimizer's param_groups lr); with several
          optimizers a number for all or one per optimizer (default: each one's param_groups lr).
        loss_scale: GradScaler.get_scale() for fp16.
        """
        step = int(step)
        full = self._shadow_step(step)
        if self._coll is not None:
            samples, offsets = self._gather_local(samples), self._gather_local(offsets)
        if self._norms is not None:
            self._norms.reset()
        self._loss_scale = None if loss_scale is None else _as_float(loss_scale)
        if self._sharded is not None:
            self._gathered = self._sharded.gather() if full else None  # collective: every rank gathers
        if not self.is_recording:
            return
        self._begin_step_local(step, samples=samples, offsets=offsets, lr=lr, loss_scale=loss_scale)

    def _shadow_step(self, step):
        """Whether `step` takes a full snapshot: the decision _take_slot makes from the ring, made from
        step numbers alone so that every rank (only one keeps a ring) knows when a sharded model is gathered."""
        last, last_full = self._shadow
        if last is not None and (step <= last or (self.snapshot_every and step != last + 1)):
            last_full = None
        full = self.snapshot_every is None or last_full is None or step - last_full >= self.snapshot_every
        self._shadow = (step, step if full else last_full)
        return full

    def _gather_local(self, rows):
        """This rank's rows (a flat list or 1-D tensor) -> every rank's, gathered; a list of per-rank
        lists is taken as already gathered (no collective)."""
        if rows is None:
            return None
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        rows = list(rows)
        if rows and isinstance(rows[0], (list, tuple, torch.Tensor)):
            return rows
        return self._coll.gather_objects([int(v) for v in rows])

    def _snapshot_gathered(self, slot):
        """A sharded model's snapshot: the full tensors gathered at begin_step, copied into the slot."""
        if self._gathered is None:
            raise CaptureError(f"step {slot.step}: a full snapshot without a gather (every rank must call begin_step "
                               "with the same step numbers)")
        params, state = self._gathered
        self._gathered = None
        for i, name in enumerate(self.names):
            if name not in params:
                raise CaptureError(f"the gathered full state dict has no {name!r} (it has {sorted(params)[:6]} ...)")
            with torch.no_grad():
                slot.params[i].copy_(params[name])
            st = state.get(name)
            if st and st.get("exp_avg") is not None:
                for which in ("exp_avg", "exp_avg_sq"):
                    with torch.no_grad():
                        slot.moment_buffer(which, i, st[which]).copy_(st[which])
                slot.has_moments[i] = True
                step = st.get("step", 0)
                slot.adam_steps.append(float(step.item() if isinstance(step, torch.Tensor) else step))

    def end_step(self, *, loss=None, local_loss=None, grad_norm=None, rank_losses=None, rank_grad_norms=None,
                 skipped=None):
        """Record what the job logged for the step begun last; dump the window on a non-finite loss
        (or a non-finite grad_norm outside fp16 loss scaling). Returns the bundle path when it dumped
        (distributed: on every rank).

        loss: the step's loss as the job logs it (mean over micro-batches and ranks).
        local_loss: distributed: this rank's own loss (mean over its micro-batches). The recorder
          gathers every rank's into rank_losses and, without loss=, logs their mean as the loss.
        grad_norm: what clip_grad_norm_ returned (the global norm, before clipping).
        rank_grad_norms: default, distributed: each rank's norm before the all-reduce, measured by
          the comm hook the recorder installed.
        """
        if loss is None and local_loss is None:
            raise CaptureError("end_step needs loss= (the step's loss) or local_loss= (this rank's own)")
        if self._coll is None:
            return self._end_step_local(loss=loss if loss is not None else local_loss, grad_norm=grad_norm,
                                        rank_losses=rank_losses, rank_grad_norms=rank_grad_norms, skipped=skipped)
        # clip_grad_norm_ under fully_shard returns a DTensor holding each rank's partial norm, whose item()
        # is this rank's part alone: make it whole here, on every rank (full_tensor() is collective).
        loss, local_loss, grad_norm = (x.full_tensor() if isinstance(x, torch.Tensor) and hasattr(x, "full_tensor")
                                       else x for x in (loss, local_loss, grad_norm))
        own, valid = self._norms.value(self._loss_scale) if self._norms is not None else (math.nan, False)
        gathered = self._coll.gather_floats([_as_float(local_loss) if local_loss is not None else None, own,
                                             1.0 if valid else 0.0])
        if rank_losses is None and local_loss is not None:
            rank_losses = [v[0] for v in gathered]
        if loss is None:
            loss = sum(rank_losses) / len(rank_losses)
        if rank_grad_norms is None and self._norms is not None:
            if all(v[2] == 1.0 for v in gathered):
                rank_grad_norms = [v[1] for v in gathered]
            elif not self._norms_warned and self.is_recording:
                self._norms_warned = True
                import warnings
                warnings.warn("nanreplay_capture: a gradient bucket was all-reduced more than once in a step (or "
                              "not at all), so the step's per-rank gradient norms are not recorded; with gradient "
                              "accumulation, run every micro-batch but the last under model.no_sync()")

        def record():
            return self._end_step_local(loss=loss, grad_norm=grad_norm, rank_losses=rank_losses,
                                        rank_grad_norms=rank_grad_norms, skipped=skipped)
        path = self._coll.agree(record)  # the recording rank's outcome (a bundle path or None), on every rank
        if path is not None:
            self.incident_path = path
        return path

    def dump(self, path=None, *, symptom="captured on demand", incident_step=None, data_copy=None):
        """Write the recorded window as a bundle at `path` (default `<out_dir>/capture-step<last>`);
        see _dump_local. Distributed: every rank calls it; the recording rank writes, and every rank
        gets the path."""
        def write():
            return self._dump_local(path, symptom=symptom, incident_step=incident_step, data_copy=data_copy)
        return write() if self._coll is None else self._coll.agree(write)

    def _begin_step_local(self, step, *, samples=None, offsets=None, lr=None, loss_scale=None):
        """Snapshot the parameters and AdamW state at the start of `step` (call before forward).

        samples: dataset indices the step reads, per rank in read order ([[...], ...]; a flat list when
          world_size is 1); sample i is tokens [i*seq_len, i*seq_len + seq_len + 1) of the stream.
        offsets: instead of samples, the first token (in the concatenated stream) of each row's
          seq_len + 1 window, for loaders that read at arbitrary offsets (e.g. nanoGPT's get_batch).
        Neither: derived from data.sampler (randperm).
        lr: the step's learning rate (default: the optimizer's param_groups lr); with several
          optimizers a number for all or one per optimizer (default: each one's param_groups lr).
        loss_scale: GradScaler.get_scale() for fp16.
        """
        step = int(step)
        # The run went back (a restart) or, when rolling forward, skipped steps: the old window is not its past.
        if self._ring and (step <= self._ring[-1].step or (self.snapshot_every and step != self._ring[-1].step + 1)):
            self._free.extend(s for s in self._ring if s.full)
            self._ring.clear()
        slot = self._take_slot(step)
        slot.step = step
        slot.sampler = self.sampler
        slot.rows, slot.rows_are_samples = self._rows(step, samples, offsets)
        slot.lr = self._optimizer_lr(lr)
        slot.loss_scale = _as_float(loss_scale)
        if slot.full:
            self._snapshot(slot)
            self._copying = slot
        self._ring.append(slot)

    def _snapshot(self, slot):
        """Copies the parameters and AdamW state into the slot's host buffers. On CUDA the copies
        run on a side stream, after the work already queued (the previous update) and overlapping
        this step's forward and backward; end_step() (and, on torch >= 2.0, a pre-hook on
        optimizer.step) makes the next update wait for them, since it changes those tensors in place."""
        if self._sharded is not None:
            return self._snapshot_gathered(slot)
        # Fused experts are copied whole (one contiguous copy each); their parts are views of the host copy.
        pairs = [(slot.params[i], p) for i, p in enumerate(self.params) if i not in self._expert_of]
        pairs += list(zip(slot.fused, self._expert_groups))
        copied = set()  # (moment, fused tensor) already queued
        device_steps = []
        for i, p in enumerate(self.params):
            opt, kind = self._param_owner(i)
            st = opt.state.get(self._held[i])
            if kind != "adamw":  # the class's state entries by name
                entries = [k for k in _KIND_STATE[kind] if isinstance((st or {}).get(k), torch.Tensor)]
                slot.entries[i] = entries
                for k in entries:
                    entry = self._rows_of(i, st[k])
                    pairs.append((slot.state_buffer(k, i, entry), entry))
                if not st or "step" not in st:
                    continue
            elif not st or "exp_avg" not in st:
                continue
            else:
                for which in ("exp_avg", "exp_avg_sq"):
                    if i in self._expert_of:  # the fused tensor's whole moment, once; this part a view of it
                        whole = slot.expert_moment(which, i, st[which])
                        if (which, self._expert_of[i][0]) not in copied:
                            copied.add((which, self._expert_of[i][0]))
                            pairs.append((whole, st[which]))
                        continue
                    moment = self._rows_of(i, st[which])
                    pairs.append((slot.moment_buffer(which, i, moment), moment))
                slot.has_moments[i] = True
            step = st.get("step", 0)  # AdamW bumps it in place: keep its value, not the tensor
            if isinstance(step, torch.Tensor) and step.is_cuda:
                device_steps.append(step.detach().reshape(()).double())
            else:
                slot.adam_steps.append(float(step))
        if not self._async:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.params[0].device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        with torch.no_grad(), torch.cuda.stream(self._copy_stream):
            for dst, src in pairs:
                dst.copy_(src.detach(), non_blocking=True)
            if device_steps:
                slot.device_steps = slot.step_buffer(len(device_steps))
                slot.device_steps.copy_(torch.stack(device_steps), non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(self._copy_stream)

    def _rows_of(self, i, t):
        """Parameter i's part of `t`, a state tensor shaped as what the optimizer holds (_held): all of it,
        or a fused parameter's rows of this part (the split the parameters take, _split_fused)."""
        fused = self._fused.get(self.names[i])
        return t if fused is None else t.narrow(0, fused[2], fused[3])

    def _order_update_after_copies(self, *_):
        """The update about to run rewrites what the newest full slot is still copying: make it wait."""
        if self._copying is not None and self._copying.event is not None:
            torch.cuda.current_stream(self.params[0].device).wait_event(self._copying.event)
            self._copying = None

    def _end_step_local(self, *, loss, grad_norm=None, rank_losses=None, rank_grad_norms=None, skipped=None):
        """Record what the job logged for the step begun last; dump the window on a non-finite loss
        (or a non-finite grad_norm outside fp16 loss scaling). Returns the bundle path when it dumped."""
        if not self._ring or self._ring[-1].ended:
            raise CaptureError("end_step() without a matching begin_step()")
        slot = self._ring[-1]
        slot.logged = {"loss": _as_float(loss), "grad_norm": _as_float(grad_norm)}
        if rank_losses is not None:
            slot.logged["rank_losses"] = [_as_float(v) for v in rank_losses]
        if rank_grad_norms is not None:
            slot.logged["rank_grad_norms"] = [_as_float(v) for v in rank_grad_norms]
        slot.skipped = None if skipped is None else bool(skipped)
        slot.ended = True
        self._order_update_after_copies()
        if self.self_check and self.self_check_result is None and slot.logged["loss"] is not None \
                and math.isfinite(slot.logged["loss"]) and self.source.one_dtype:
            self.self_check_result = run_self_check(self, slot)  # CaptureError on a gap
        symptom = self._symptom(slot)
        if symptom and self.incident_path is None:
            self.incident_path = self._dump_local(self._unique_dir(f"incident-step{slot.step}"), symptom=symptom,
                                           incident_step=slot.step)
            return self.incident_path
        return None

    def _symptom(self, slot):
        loss, norm = slot.logged["loss"], slot.logged["grad_norm"]
        if loss is not None and not math.isfinite(loss):
            return f"loss={_json_number(loss)}"
        scaler_overflow = self.precision == "fp16" or slot.skipped
        if norm is not None and not math.isfinite(norm) and not scaler_overflow:
            return f"grad_norm={_json_number(norm)}"
        return None

    def _take_slot(self, step):
        if self.snapshot_every is not None:
            return self._take_snapshot_slot(step)
        if len(self._ring) >= self.window:
            slot = self._ring.popleft()
        elif self._free:
            slot = self._free.pop()
        else:
            return self._new_slot()
        return self._reused(slot)

    def _take_snapshot_slot(self, step):
        """A full slot every snapshot_every steps, a light one otherwise. A third snapshot evicts
        the oldest with the light records before the second: the ring then starts at a snapshot."""
        fulls = [s for s in self._ring if s.full]
        if fulls and step - fulls[-1].step < self.snapshot_every:
            return self._new_slot(full=False)
        if len(fulls) >= 2:
            while self._ring[0] is not fulls[1]:
                evicted = self._ring.popleft()
                if evicted.full:
                    self._free.append(evicted)
        return self._reused(self._free.pop()) if self._free else self._new_slot()

    def _new_slot(self, full=True):
        """A slot with host buffers for the parameters: one per fused expert tensor, whose experts' parts are
        views of it (_expert_layout), one per other parameter."""
        return _StepSlot(self.params, self._pin, full=full, experts=(self._expert_groups, self._expert_of))

    def _reused(self, slot):
        if slot.event is not None:
            slot.event.synchronize()  # its previous copies must land before they are overwritten
        slot.reset()
        return slot

    def _rows(self, step, samples, offsets):
        d = self.data
        world, per_rank = d["world_size"], d["micro_batch_size"] * d["grad_accum_steps"]
        if samples is not None and offsets is not None:
            raise CaptureError("give samples= or offsets=, not both")
        given = samples if samples is not None else offsets
        if given is None:
            if self.sampler is None:
                raise CaptureError("begin_step needs samples= (or offsets=) when data.sampler is None")
            given = _randperm_samples(self.sampler, self.source.num_samples(d["seq_len"]), world, per_rank, step)
            samples = given
        if isinstance(given, torch.Tensor):
            given = given.tolist()
        if world == 1 and len(given) and not isinstance(given[0], (list, tuple, torch.Tensor)):
            given = [given]
        rows = [[int(v) for v in (r.tolist() if isinstance(r, torch.Tensor) else r)] for r in given]
        if len(rows) != world or any(len(r) != per_rank for r in rows):
            raise CaptureError(f"step {step}: expected {world} rank list(s) of micro_batch_size * grad_accum_steps "
                               f"= {per_rank} entries, got {[len(r) for r in rows]}")
        if samples is not None:
            rows = [[i * d["seq_len"] for i in r] for r in rows]
        return rows, samples is not None

    # -- writing a bundle -----------------------------------------------------

    def _unique_dir(self, name):
        path = self.out_dir / name
        n = 1
        while path.exists():
            n += 1
            path = self.out_dir / f"{name}-{n}"
        return path

    def _dump_local(self, path=None, *, symptom="captured on demand", incident_step=None, data_copy=None):
        """Write the recorded window as a bundle at `path` (default `<out_dir>/capture-step<last>`),
        atomically: everything goes to a temporary sibling directory renamed at the end.

        data_copy: "whole" copies every shard; "window" writes one compact shard holding only the
        token windows the captured steps read and rewrites the samples as explicit indices into it;
        "auto" (default) copies whole when the shards total at most `whole_copy_limit` bytes and
        every row starts at a sample boundary. Returns the bundle path.
        """
        slots = list(self._ring)
        if not slots:
            raise CaptureError("nothing recorded yet: call begin_step() first")
        assert slots[0].full, "a window starts at a full step"
        for slot in slots:
            if slot.event is not None:
                slot.event.synchronize()
        path = Path(path) if path is not None else self._unique_dir(f"capture-step{slots[-1].step}")
        if path.exists() and any(path.iterdir()):
            raise CaptureError(f"{path} exists and is not empty")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            (tmp / "data").mkdir(parents=True)
            optimizer = self._optimizer_manifest()  # before the steps: their lr objects use its group names
            data_manifest, step_samples, step_extra = self._write_data(tmp, slots, data_copy or self.data_copy)
            steps = []
            for slot, samples, extra in zip(slots, step_samples, step_extra):
                rel = f"steps/{slot.step}"
                self._write_step(tmp / rel, slot)
                steps.append(dict({"step": slot.step, "dir": rel, "samples": samples}, **extra))
            manifest = {
                "format": "nanreplay.bundle",
                "version": 1,
                "model": self.model_config,
                "precision": {"compute": self.precision},
                "optimizer": optimizer,
                "data": data_manifest,
                "steps": steps,
                "incident": {"step": slots[-1].step if incident_step is None else incident_step,
                             "symptom": symptom},
                "capture": {"writer": "nanreplay_capture", "version": CAPTURE_VERSION,
                            "torch": torch.__version__, "host": socket.gethostname(),
                            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "window": self.window,
                            **({"snapshot_every": self.snapshot_every} if self.snapshot_every else {})},
            }
            if self.defaulted:  # docs/bundle-format.md, "Provenance": the report names them beside a gap
                manifest["provenance"] = {
                    f"model.{k}": {"from": "default", "value": v, "detail": "bundle v1's default: neither the model nor "
                                   "model_config says it (the capture self-check compared the loss with it)"}
                    for k, v in self.defaulted.items()}
            _write_json(tmp / "manifest.json", manifest)  # last: its presence marks a complete bundle
            if path.exists():
                path.rmdir()
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def _write_step(self, step_dir, slot):
        step_dir.mkdir(parents=True)
        if slot.full:
            self._write_checkpoint(step_dir, slot)
        _write_json(step_dir / "state.json", self._step_state(slot))

    def _write_checkpoint(self, step_dir, slot):
        write_safetensors(step_dir / "model.safetensors", list(zip(self.names, slot.params)))
        tensors = []
        for i, name in enumerate(self.names):
            if self._param_owner(i)[1] != "adamw":
                tensors += self._state_by_name(slot, i, name)
                continue
            for which, bufs in (("exp_avg", slot.exp_avg), ("exp_avg_sq", slot.exp_avg_sq)):
                if slot.has_moments[i]:
                    tensors.append((f"{name}.{which}", bufs[i]))
                else:  # no AdamW state yet (before the first update): zeros, as AdamW starts
                    tensors.append((f"{name}.{which}", ("zeros", slot.params[i].dtype, tuple(slot.params[i].shape))))
        adam_steps = [int(s) for s in slot.adam_steps]
        if slot.device_steps is not None:
            adam_steps += [int(s) for s in slot.device_steps.tolist()]
        if len(set(adam_steps)) > 1:
            raise CaptureError(f"step {slot.step}: AdamW step counts differ across parameters "
                               f"({sorted(set(adam_steps))}); bundle v1 has one")
        tensors.append(("step", torch.tensor(adam_steps[0] if adam_steps else 0, dtype=torch.int64)))
        write_safetensors(step_dir / "optimizer.safetensors", tensors)

    def _step_state(self, slot):
        lr = slot.lr
        if isinstance(lr, list):  # several optimizers at their own lrs: one per group name (docs/optimizers.md)
            lr = {name: _json_number(lr[j]) for name, j in self._lr_owner.items()}
        else:
            lr = _json_number(lr)
        state = {"step": slot.step, "lr": lr}
        if slot.loss_scale is not None:
            state["loss_scale"] = _json_number(slot.loss_scale)
        if slot.skipped is not None:
            state["skipped"] = slot.skipped
        logged = {}
        for key, value in slot.logged.items():
            if value is None:
                continue
            logged[key] = [_json_number(v) for v in value] if isinstance(value, list) else _json_number(value)
        state["logged"] = logged
        return state

    def _write_data(self, root, slots, mode):
        """Writes the token data the slots read; returns (manifest "data", samples per slot, extra
        keys per step entry)."""
        d, src = self.data, self.source
        L = d["seq_len"]
        for slot in slots:
            for rank, rows in enumerate(slot.rows):
                for row, start in enumerate(rows):
                    if start < 0 or start + L + 1 > src.total_tokens:
                        raise CaptureError(f"step {slot.step} rank {rank} row {row}: tokens [{start}, {start + L + 1}) "
                                           f"lie outside the {src.total_tokens}-token stream")
        aligned = all(start % L == 0 for slot in slots for rows in slot.rows for start in rows)
        if mode == "auto":
            mode = "whole" if aligned and src.total_bytes <= self.whole_copy_limit else "window"
        if mode == "whole" and not aligned:
            raise CaptureError("data_copy='whole' needs every row to start at a sample boundary (offset % seq_len == 0)")
        base = {"seq_len": L, "micro_batch_size": d["micro_batch_size"],
                "grad_accum_steps": d["grad_accum_steps"], "world_size": d["world_size"]}
        if mode == "whole":
            shards = self._copy_whole_shards(root)
            samplers = {tuple(sorted(s.sampler.items())) if s.sampler else None for s in slots}
            sampler = slots[0].sampler if len(samplers) == 1 and slots[0].sampler else {"kind": "explicit"}
            if sampler["kind"] == "explicit" and self.sampler is not None:
                base["original_samplers"] = {str(s.step): s.sampler for s in slots}
            samples = [[[start // L for start in rows] for rows in slot.rows] for slot in slots]
            data = dict({"shards": shards, "sampler": sampler}, **base)
            data["capture"] = {"mode": "whole"}
            return data, samples, [{} for _ in slots]
        if not src.one_dtype:
            raise CaptureError("data_copy='window' needs all shards in one dtype")
        shard, runs, index = self._copy_windows(root, slots)
        samples = [[[index[start] for start in rows] for rows in slot.rows] for slot in slots]
        data = dict({"shards": [shard], "sampler": {"kind": "explicit"}}, **base)
        data["capture"] = {"mode": "window", "runs": runs,
                           "source_shards": [{"path": str(s["path"]), "dtype": s["dtype"], "tokens": s["tokens"],
                                              "header_bytes": s["header"]} for s in src.shards]}
        if self.sampler is not None:
            data["capture"]["original_sampler"] = slots[-1].sampler
        # What the run read, in its own terms, beside the rewritten indices.
        if all(slot.rows_are_samples for slot in slots):
            extra = [{"original_samples": [[start // L for start in rows] for rows in slot.rows]} for slot in slots]
        else:
            extra = [{"original_offsets": [list(rows) for rows in slot.rows]} for slot in slots]
        return data, samples, extra

    def _copy_whole_shards(self, root):
        shards, used = [], set()
        for i, s in enumerate(self.source.shards):
            name = s["path"].name if s["path"].name not in used else f"{i:03d}_{s['path'].name}"
            used.add(name)
            rel = f"data/{name}"
            digest = hashlib.sha256()
            with open(s["path"], "rb") as f, open(root / rel, "wb") as out:
                f.seek(s["header"])
                left = s["tokens"] * s["width"]
                while left:
                    chunk = f.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise CaptureError(f"{s['path']} shrank while it was being copied")
                    digest.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
            shards.append({"path": rel, "dtype": s["dtype"], "tokens": s["tokens"], "sha256": digest.hexdigest()})
        return shards

    def _copy_windows(self, root, slots):
        """One compact shard holding every window the slots read. Rows whose windows follow each
        other at stride seq_len in the source share tokens there, so they are kept together as a
        run; each run starts at a sample boundary of the new stream and is followed by the rest of
        the source's next sample (real tokens, not filler, so data checks see real data)."""
        L, src = self.data["seq_len"], self.source
        starts = sorted({start for slot in slots for rows in slot.rows for start in rows})
        runs_src = []
        for start in starts:
            if runs_src and start == runs_src[-1][0] + L * runs_src[-1][1]:
                runs_src[-1][1] += 1
            else:
                runs_src.append([start, 1])
        index, runs = {}, []
        digest, written = hashlib.sha256(), 0
        rel = "data/window.bin"
        width = src.shards[0]["width"]
        with open(root / rel, "wb") as out:
            for start, count in runs_src:
                assert written % L == 0
                copied = min((count + 1) * L, src.total_tokens - start)  # count windows + one sample of context
                raw = src.read(start, copied)
                length = copied
                if length % L and start != runs_src[-1][0]:
                    # Cut short by the end of the stream with runs still to come (rows at arbitrary
                    # offsets): fill up to the next sample boundary with the run's own tokens,
                    # which no sample reads.
                    pad = L - length % L
                    raw += (raw * (pad // length + 1))[:pad * width]
                    length += pad
                out.write(raw)
                digest.update(raw)
                for k in range(count):
                    index[start + k * L] = written // L + k
                runs.append({"bundle_offset": written, "source_offset": start, "tokens": copied})
                written += length
        shard = {"path": rel, "dtype": src.shards[0]["dtype"], "tokens": written, "sha256": digest.hexdigest()}
        assert written * width == (root / rel).stat().st_size
        return shard, runs, index
