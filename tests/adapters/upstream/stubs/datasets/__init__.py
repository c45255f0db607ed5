"""Import stand-in for Hugging Face ``datasets`` (upstream test runs only).

SGLang's ``sglang.test.test_utils`` imports its benchmark datasets, which import
``datasets.load_dataset`` at module level.  The allocator tests never load a dataset, so the
name only has to exist; calling it says why it cannot work here.
"""


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets stub: load_dataset is not available in the CPU upstream-test overlay")
