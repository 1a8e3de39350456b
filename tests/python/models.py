"""The small models the Python tests train and record, each with a batch
of its input."""

import torch


def small_cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 16 * 16, 10))


def small_transformer():
    # No dropout, so that every step is deterministic.
    return torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(d_model=64, nhead=4,
                                         dim_feedforward=256, dropout=0.0,
                                         batch_first=True),
        torch.nn.TransformerEncoderLayer(d_model=64, nhead=4,
                                         dim_feedforward=256, dropout=0.0,
                                         batch_first=True),
        torch.nn.Flatten(), torch.nn.Linear(64 * 64, 10))


def small_mlp():
    # BatchNorm (buffers a recompute must not update twice) and dropout (a
    # recompute must draw the same mask).
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024),
        torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024),
        torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 10))


CASES = {
    "cnn": (small_cnn, lambda: torch.randn(16, 3, 32, 32)),
    "transformer": (small_transformer, lambda: torch.randn(16, 64, 64)),
    "mlp": (small_mlp, lambda: torch.randn(128, 256)),
}
