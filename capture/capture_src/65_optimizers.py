## Part of capture/nanreplay_capture.py: optimizers beyond AdamW, read by name (a base of Recorder).
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


def _json_hyper(v):
    """A param_groups value as the manifest writes it: tuples as lists, tensors as numbers."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (tuple, list)):
        return [_json_hyper(x) for x in v]
    return float(v) if isinstance(v, float) else v


class _OptimizerByName:
    """Recorder's manifest section and state for the classes beyond AdamW (docs/capture.md)."""

    def _optimizer_manifest_by_name(self):
        """A class beyond AdamW: each group's hyper-parameters under the class's own names; the first
        group's at the top level, each group that differs in `groups` with its parameters' exact keys."""
        kind, groups = self._opt_kind, self.optimizer.param_groups
        if len({_as_float(g["lr"]) for g in groups if g.get("lr") is not None}) > 1:
            raise CaptureError("the param groups' learning rates differ; the bundle records one lr per step")
        index = {id(p): i for i, p in enumerate(self.params)}
        settings = [{k: _json_hyper(g[k]) for k in _KIND_HYPER[kind] if k in g} for g in groups]
        out = dict({"kind": kind}, **settings[0])
        extra = [{"name": f"{kind}{n}", "params": [self.names[index[id(p)]] for p in g["params"]], **st}
                 for n, (g, st) in enumerate(zip(groups, settings)) if n and st != settings[0] and g["params"]]
        if extra:
            out["groups"] = extra
        if self.grad_clip is not None:
            out["grad_clip"] = float(self.grad_clip)
        return out

    def _state_by_name(self, slot, i, name):
        """A class beyond AdamW: its state entries under their own names; before the parameter's first
        update, the zeros each class starts from."""
        if slot.entries[i]:
            return [(f"{name}.{k}", slot.state_bufs[(k, i)]) for k in slot.entries[i]]
        p, group = slot.params[i], next(g for g in self.optimizer.param_groups
                                        if any(q is self.params[i] for q in g["params"]))
        shape, kind = tuple(p.shape), self._opt_kind
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
