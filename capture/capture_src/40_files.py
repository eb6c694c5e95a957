## Part of capture/nanreplay_capture.py: files (safetensors, JSON, atomic directories) and the token source.
## scripts/gen_capture.py joins capture/capture_src/*.py in name order into that one file (these '##'
## lines dropped); edit here, then run it. Names used here may be defined in the other parts.
# ---------------------------------------------------------------------------
# Files: safetensors, JSON with the bundle format's non-finite strings, atomic directories.

def _tensor_bytes(t):
    """A zero-copy view of a contiguous CPU tensor's bytes (kept alive by the caller)."""
    if t.numel() == 0:
        return b""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def write_safetensors(path, tensors):
    """Writes [(name, tensor)] in the safetensors layout: 8-byte LE header length, JSON header
    padded with spaces to a multiple of 8, raw little-endian data in list order. An entry may be
    (name, ("zeros", dtype, shape)) to write zeros without allocating them."""
    if sys.byteorder != "little":
        raise CaptureError("safetensors data is little-endian; this host is not")
    header, parts, offset = {"__metadata__": {"format": "pt", "writer": "nanreplay_capture"}}, [], 0
    for name, t in tensors:
        if isinstance(t, tuple):
            _, dtype, shape = t
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        else:
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.detach().to("cpu").contiguous()
            dtype, shape, nbytes = t.dtype, tuple(t.shape), t.numel() * t.element_size()
        if dtype not in _SAFETENSORS_DTYPE:
            raise CaptureError(f"{name}: dtype {dtype} is not one bundle v1 stores (F32, BF16, F16, I64)")
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        parts.append((t, nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t, nbytes in parts:
            if isinstance(t, tuple):
                zeros = bytes(min(nbytes, _COPY_CHUNK))
                left = nbytes
                while left:
                    f.write(zeros[:min(left, len(zeros))])
                    left -= min(left, len(zeros))
            else:
                f.write(_tensor_bytes(t))


def _json_number(x):
    """JSON has no NaN: bundle v1 writes non-finite numbers as "nan", "inf", "-inf"."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


_NUMBER_LIST = re.compile(r"\[\s+((?:-?[\d.eE+-]+,\s+)*-?[\d.eE+-]+)\s+\]")


def _write_json(path, obj):
    """Indented JSON, with lists of numbers (sample indices) kept on one line."""
    text = json.dumps(obj, indent=2, allow_nan=False)
    text = _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    Path(path).write_text(text + "\n")


def _as_float(x):
    """float() of a Python number or a one-element tensor (a CUDA tensor synchronises here)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return float(x.detach().reshape(()).item())
    return float(x)


# ---------------------------------------------------------------------------
# Token data: the run's shards as one stream, as bundle v1 defines it
# (docs/bundle-format.md, "Data: samples and samplers").

class _TokenSource:
    """The run's shards concatenated into one token stream (raw LE uint16/uint32, an
    optional fixed-size header per file skipped), read with plain file I/O."""

    def __init__(self, data):
        default_dtype = data.get("token_dtype", "uint16")
        default_header = int(data.get("header_bytes", 0))
        self.shards = []
        start = 0
        for i, entry in enumerate(data["shards"]):
            spec = dict(entry) if isinstance(entry, dict) else {"path": entry}
            path = Path(spec["path"])
            dtype = spec.get("dtype", default_dtype)
            header = int(spec.get("header_bytes", default_header))
            if dtype not in _TOKEN_WIDTH:
                raise CaptureError(f"data.shards[{i}]: dtype must be uint16 or uint32, got {dtype!r}")
            width = _TOKEN_WIDTH[dtype]
            size = path.stat().st_size - header
            if size <= 0 or size % width:
                raise CaptureError(f"{path}: {size} data bytes after a {header}-byte header is not a "
                                   f"whole number of {dtype} tokens")
            tokens = size // width
            self.shards.append({"path": path, "dtype": dtype, "width": width, "header": header,
                                "tokens": tokens, "start": start})
            start += tokens
        if not self.shards:
            raise CaptureError("data.shards is empty")
        self.total_tokens = start
        self.total_bytes = sum(s["tokens"] * s["width"] for s in self.shards)
        self.one_dtype = len({s["dtype"] for s in self.shards}) == 1

    def num_samples(self, seq_len):
        return max(0, (self.total_tokens - 1) // seq_len)

    def read(self, begin, count):
        """Raw bytes of tokens [begin, begin + count) of the stream (one dtype assumed)."""
        out = bytearray()
        for s in self.shards:
            lo, hi = max(begin, s["start"]), min(begin + count, s["start"] + s["tokens"])
            if lo >= hi:
                continue
            with open(s["path"], "rb") as f:
                f.seek(s["header"] + (lo - s["start"]) * s["width"])
                out += f.read((hi - lo) * s["width"])
        return bytes(out)


def _randperm_samples(sampler, num_samples, world, per_rank_step, step):
    """PyTorch's DistributedSampler (shuffle, drop_last) as bundle v1 defines `randperm` (docs/bundle-format.md)."""
    g = torch.Generator()
    g.manual_seed(int(sampler["seed"]) + int(sampler.get("epoch", 0)))
    perm = torch.randperm(num_samples, generator=g).tolist()
    total = (num_samples // world) * world
    start = (step - int(sampler.get("epoch_start_step", 0))) * per_rank_step
    if start < 0 or start + per_rank_step > total // world:
        raise CaptureError(f"step {step} lies outside the randperm sampler's epoch; pass samples= explicitly")
    return [perm[r:total:world][start:start + per_rank_step] for r in range(world)]


