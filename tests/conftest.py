import pytest
import torch

# Tiny test models gain nothing from intra-op threads, and on a busy 2-core machine the
# thread pool's spinning makes each tiny forward up to 100x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2 checkpoint folder, which the zoo prepares from its offline package."""
    zoo = pytest.importorskip("hf_invisiblelora.zoo", reason="the zoo extra is not installed")
    try:
        return zoo.assets.prepare("smollm2")
    except zoo.AssetUnavailable as e:
        pytest.skip(f"SmolLM2 cannot be had here: {e}")
