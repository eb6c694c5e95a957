## Part of capture/nanreplay_capture.py: the Recorder's optimizers (one, or a run's several), classes beyond AdamW read by name (a base of Recorder).
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# Optimizers beyond AdamW.

# The optimizer classes the replay follows, by type(opt).__module__ + "." + __qualname__ (a subclass of
# torch.optim.AdamW is AdamW), onto the manifest's kind; per kind the state entries recorded and the
# param_groups' hyper-parameters written, under the class's own names (docs/optimizers.md).
_OPTIMIZER_KINDS = {"torch.optim.adamw.AdamW": "adamw", "torch.optim.adam.Adam": "adam",
                    "torch.optim._adafactor.Adafactor": "adafactor",
                    "transformers.optimization.Adafactor": "adafactor_hf", "torch.optim._muon.Muon": "muon"}
_KIND_STATE = {"adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "adafactor": ("row_var", "col_var", "variance"),
               "adafactor_hf": ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"),
               "muon": ("momentum_buffer",)}
_KIND_HYPER = {"adam": ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
               "adafactor": ("beta2_decay", "eps", "d", "weight_decay", "maximize"),
               "adafactor_hf": ("eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter",
                                "relative_step", "warmup_init"),
               "muon": ("weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
                        "use_addmm")}
# param_groups keys that change no math the replay derives (the lr is recorded per step).
_OPTIMIZER_PLUMBING = ("params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable", "name")
# AdamW's hyper-parameters, written for an AdamW beside another optimizer (its groups are then groups of
# their own kind, which start from the class's defaults: every setting is written).
_ADAMW_HYPER = ("betas", "eps", "weight_decay")
# The kinds whose update and state act on each element alone: the only ones a fused parameter's parts
# (Phi-3's qkv_proj, gate_up_proj) take apart as the fused tensor took them.
_ELEMENTWISE_KINDS = ("adamw", "adam")


def join_optimizer_groups(section, taken, kind, groups, prefix):
    """The manifest's optimizer `section` of a run's first optimizer, joined by another optimizer of the
    same run (torch.optim.Muon's runs give the embeddings, norms and head to an AdamW): each of the
    other's param groups, [(bundle keys, settings)], becomes an entry of `groups` of its own `kind`,
    named `{prefix}{kind}{i}`. `taken`: the keys the section's optimizer updates. A key that two
    optimizers update raises CaptureError naming it. Shared with `nanreplay import --aux-optimizer`."""
    taken, out = set(taken), list(section.get("groups", []))
    for i, (keys, settings) in enumerate(groups):
        if not keys:
            continue
        both = sorted(taken & set(keys))
        if both:
            raise CaptureError(f"{both[0]} is in both optimizers' groups")
        taken |= set(keys)
        out.append(dict({"name": f"{prefix}{kind}{i}", "params": list(keys), "kind": kind}, **settings))
    return dict(section, groups=out)


def _json_hyper(v):
    """A param_groups value as the manifest writes it: tuples as lists, tensors as numbers."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (tuple, list)):
        return [_json_hyper(x) for x in v]
    return float(v) if isinstance(v, float) else v


class _OptimizerByName:
    """Recorder's optimizers: their check, the manifest section, the lr and the state of the classes
    beyond AdamW, for one optimizer or a run's several
    optimizers (docs/capture.md)."""

    def _param_owner(self, i):
        """(optimizer, kind) that updates parameter i."""
        j = self._owner[i]
        return self.optimizers[j], self._opt_kinds[j]

    def _held_indices(self):
        """{id(tensor an optimizer holds): [bundle indices]}: a fused parameter holds several (_split_fused)."""
        index = {}
        for i, held in enumerate(self._held):
            index.setdefault(id(held), []).append(i)
        return index

    def _group_settings(self, j):
        """Optimizer j's param groups as [(bundle keys, settings under the class's own names)]."""
        opt, kind = self.optimizers[j], self._opt_kinds[j]
        index = self._held_indices()
        return [([self.names[i] for p in g["params"] for i in index[id(p)]],
                 {k: _json_hyper(g[k]) for k in _KIND_HYPER.get(kind, _ADAMW_HYPER) if k in g})
                for g in opt.param_groups]

    def _optimizer_manifest_by_name(self):
        """A class beyond AdamW: each group's hyper-parameters under the class's own names; the first
        group's at the top level, each group that differs in `groups` with its parameters' exact keys."""
        kind, groups = self._opt_kinds[0], self.optimizers[0].param_groups
        if len({_as_float(g["lr"]) for g in groups if g.get("lr") is not None}) > 1:
            raise CaptureError("the param groups' learning rates differ; the bundle records one lr per step")
        every = self._group_settings(0)
        settings = [st for _, st in every]
        out = dict({"kind": kind}, **settings[0])
        extra = [{"name": f"{kind}{n}", "params": keys, **st}
                 for n, (keys, st) in enumerate(every) if n and st != settings[0] and keys]
        if extra:
            out["groups"] = extra
        if self.grad_clip is not None:
            out["grad_clip"] = float(self.grad_clip)
        return out

    def _join_other_optimizers(self, section):
        """The first optimizer's section joined by the run's other optimizers, each param group a group of
        its own kind (join_optimizer_groups); self._lr_owner: group name -> the optimizer whose lr it takes."""
        self._lr_owner = {"default": 0}
        self._lr_owner.update({g["name"]: 0 for g in section.get("groups", [])})
        for j in range(1, len(self.optimizers)):
            taken = {self.names[i] for i in range(len(self.params)) if self._owner[i] != j}
            before = len(section.get("groups", []))
            section = join_optimizer_groups(section, taken, self._opt_kinds[j], self._group_settings(j),
                                            "aux_" if j == 1 else f"aux{j}_")
            self._lr_owner.update({g["name"]: j for g in section["groups"][before:]})
        return section

    def _state_by_name(self, slot, i, name):
        """A class beyond AdamW: its state entries under their own names; before the parameter's first
        update, the zeros each class starts from."""
        if slot.entries[i]:
            return [(f"{name}.{k}", slot.state_bufs[(k, i)]) for k in slot.entries[i]]
        opt, kind = self._param_owner(i)
        p, group = slot.params[i], next(g for g in opt.param_groups if any(q is self._held[i] for q in g["params"]))
        shape = tuple(p.shape)
        if kind == "adam":
            shapes = {"exp_avg": shape, "exp_avg_sq": shape}
            if group.get("amsgrad"):
                shapes["max_exp_avg_sq"] = shape
        elif kind == "muon":
            shapes = {"momentum_buffer": shape}
        elif kind == "adafactor":
            shapes = ({"row_var": shape[:-1] + (1,), "col_var": shape[:-2] + (1,) + shape[-1:]} if len(shape) > 1
                      else {"variance": shape})
        else:  # adafactor_hf
            shapes = ({"exp_avg_sq_row": shape[:-1], "exp_avg_sq_col": shape[:-2] + shape[-1:]} if len(shape) > 1
                      else {"exp_avg_sq": shape})
            if group.get("beta1") is not None:
                shapes["exp_avg"] = shape
        return [(f"{name}.{k}", ("zeros", p.dtype, sh)) for k, sh in shapes.items()]

    def _check_optimizer(self):
        """Each optimizer known by class name, with param_groups keys its class has; every bundle
        parameter updated by exactly one of them (self._owner[i]: which)."""
        self._opt_kinds = []
        for j, opt in enumerate(self.optimizers):
            cls = f"{type(opt).__module__}.{type(opt).__qualname__}"
            kind = "adamw" if isinstance(opt, torch.optim.AdamW) else _OPTIMIZER_KINDS.get(cls)
            if kind is None:
                raise CaptureError(f"the replay follows {', '.join(sorted(_OPTIMIZER_KINDS))}; got {cls}")
            if kind != "adamw" and self._sharded is not None:
                raise CaptureError(f"under FSDP the recorder gathers torch.optim.AdamW's state only; got {cls}")
            for g, group in enumerate(opt.param_groups):
                if kind == "adamw" and (group.get("amsgrad") or group.get("maximize")):
                    raise CaptureError("AdamW with amsgrad or maximize is not what bundle v1 replays")
                for k in group if kind != "adamw" else ():
                    if k not in _KIND_HYPER[kind] and k not in _OPTIMIZER_PLUMBING:
                        raise CaptureError(f"optimizer param_groups[{g}] has {k!r}, which the replay's "
                                           f"{kind} does not know (it reads {', '.join(_KIND_HYPER[kind])})")
            self._opt_kinds.append(kind)
        self._opt_kind = self._opt_kinds[0]
        if self._sharded is not None:  # it holds shards (or flat parameters): names are checked at each gather
            self._owner = [0] * len(self.params)
            return
        wanted = self._held_indices()
        owner = {}
        for j, opt in enumerate(self.optimizers):
            label = f"optimizer {j} ({type(opt).__qualname__}) " if len(self.optimizers) > 1 else "optimizer "
            for g, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in wanted:
                        raise CaptureError(f"{label}param_groups[{g}] holds a tensor that is not one of the "
                                           "model's bundle parameters")
                    if id(p) in owner and owner[id(p)] != j:
                        raise CaptureError(f"{self.names[wanted[id(p)][0]]} is updated by two optimizers "
                                           f"({type(self.optimizers[owner[id(p)]]).__qualname__} and "
                                           f"{type(opt).__qualname__}); each parameter has one")
                    owner[id(p)] = j
        missing = [self.names[i] for pid, held in wanted.items() if pid not in owner for i in held]
        if missing:
            raise CaptureError(f"parameters the optimizer does not update: {missing[:6]}"
                               + (" (none of the optimizers given updates them)" if len(self.optimizers) > 1 else ""))
        self._owner = [owner[id(p)] for p in self._held]
        for i, name in enumerate(self.names):
            kind = self._opt_kinds[self._owner[i]]
            if name in self._experts and kind != "adamw":
                raise CaptureError(f"{self._experts[name][0]} holds fused experts updated by {kind}: the recorder "
                                   "splits a fused expert tensor's AdamW moments only (torch.optim.AdamW)")
            if name in self._fused and kind not in _ELEMENTWISE_KINDS:
                raise CaptureError(f"{self._fused[name][0]} is fused and updated by {kind}, whose update of the "
                                   "fused matrix is not that of its parts (bundle v1 holds the parts): AdamW and "
                                   "Adam only, whose state splits row by row as the parameter does")

    def _optimizer_manifest(self):
        """The manifest's optimizer section: the first optimizer at the top level, the others' param
        groups as groups of their own kind (_join_other_optimizers)."""
        section = self._optimizer_manifest_by_name() if self._opt_kind != "adamw" else self._adamw_manifest()
        return self._join_other_optimizers(section)

    def _adamw_manifest(self):
        groups = self.optimizer.param_groups
        betas = {tuple(float(b) for b in g["betas"]) for g in groups}
        eps = {float(g["eps"]) for g in groups}
        if len(betas) != 1 or len(eps) != 1:
            raise CaptureError("bundle v1 has one AdamW betas/eps for all parameters; the param groups differ")
        decays = {float(g["weight_decay"]) for g in groups}
        nonzero = decays - {0.0}
        if len(nonzero) > 1:
            raise CaptureError(f"bundle v1 expresses one weight decay plus no_decay globs; groups use {sorted(decays)}")
        decay = nonzero.pop() if nonzero else 0.0
        index = self._held_indices()
        if self._sharded is not None:  # the optimizer holds the sharded tensors: map them by name
            index = {pid: [self.names.index(n)] for pid, n in self._sharded_names.items() if n in self.names}
            if decay and any(id(p) not in index for g in groups if float(g["weight_decay"]) == 0.0
                             for p in g["params"]):
                raise CaptureError("under FSDP with flat parameters (use_orig_params=False) the recorder cannot "
                                   "tell which parameters a weight_decay=0 group holds; use one weight decay")
        no_decay = sorted(self.names[i] for g in groups if float(g["weight_decay"]) == 0.0 and decay
                          for p in g["params"] for i in index[id(p)])
        out = {"kind": "adamw", "betas": list(betas.pop()), "eps": eps.pop(), "weight_decay": decay}
        if no_decay:
            out["no_decay"] = no_decay  # exact keys are globs that match only themselves
        if self.grad_clip is not None:
            out["grad_clip"] = float(self.grad_clip)
        return out

    def _optimizer_lr(self, given=None):
        """The step's lr: one number, or with several optimizers whose lrs differ one per optimizer (the
        state.json object keyed by group name, _step_state). `given`: begin_step's lr=, a number (every
        group) or one per optimizer."""
        if given is not None and isinstance(given, (list, tuple)):
            if len(given) != len(self.optimizers):
                raise CaptureError(f"lr= gives {len(given)} learning rates for {len(self.optimizers)} optimizers")
            per = [_as_float(v) for v in given]
        elif given is not None:
            return _as_float(given)
        else:
            per = []
            for opt in self.optimizers:
                lrs = {_as_float(g["lr"]) for g in opt.param_groups}
                if len(lrs) != 1:
                    raise CaptureError(f"param groups use different learning rates {sorted(lrs)}; bundle v1 has one "
                                       "lr per step and optimizer: pass lr= to begin_step if one of them is the real one")
                per.append(lrs.pop())
        return per[0] if len(set(per)) == 1 else per
