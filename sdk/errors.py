"""Every error the SDK raises on bad input derives from `SdkError`, and names what is wrong."""


class SdkError(Exception):
    """Base class of the SDK's own errors."""


class UnknownModelError(SdkError, KeyError):
    """A model id no plugin registered; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedConfigError(SdkError, ValueError):
    """A config feature the SDK does not implement; the message names the feature."""


class WeightsMismatchError(SdkError, ValueError):
    """A state dict that does not fit the spec: lists missing, unexpected and mis-shaped keys."""

    def __init__(self, missing=(), unexpected=(), misshaped=(), model="", wrong_dtype=()):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.misshaped = sorted(misshaped)  # (key, expected shape, got shape)
        self.wrong_dtype = sorted(wrong_dtype)  # (key, expected dtype, got dtype)
        lines = [f"state dict does not match {model or 'the model'}:"]
        for title, items in (("missing", self.missing), ("unexpected", self.unexpected)):
            if items:
                shown = ", ".join(items[:20]) + (f", ... ({len(items)} in all)" if len(items) > 20 else "")
                lines.append(f"  {title} keys: {shown}")
        for key, want, got in self.misshaped[:20]:
            lines.append(f"  mis-shaped: {key}: expected {tuple(want)}, got {tuple(got)}")
        for key, want, got in self.wrong_dtype[:20]:
            lines.append(f"  wrong dtype: {key}: expected {want}, got {got}")
        super().__init__("\n".join(lines))


class CapacityError(SdkError, ValueError):
    """Batch, context or token count over the limits the megakernel was built for."""


class KernelTimeoutError(SdkError, RuntimeError):
    """A bounded spin-wait in the megakernel expired: the kernel set its error word and exited."""


class PluginError(SdkError, RuntimeError):
    """A plugin that failed to load or registered something invalid."""
