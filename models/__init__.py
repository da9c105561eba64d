"""In-tree model packages. Each registers itself through the `megakernel_sdk.models` entry points,
exactly as a third-party package would."""
