import torch

# Tiny test models gain nothing from intra-op threads, and on a busy 2-core machine the
# thread pool's spinning makes each tiny forward up to 100x slower.
torch.set_num_threads(1)
