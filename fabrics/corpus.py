"""The configured dataset's training and validation data: one loader per `dataset` value."""

from __future__ import annotations

from fabrics.dataset_loader import CorpusData, load_c4, load_embedded
from fabrics.imdb_data import load_imdb_corpus
from utils.config import Config

DATA_SOURCES = {"embedded": load_embedded, "c4": load_c4, "imdb": load_imdb_corpus}


def load_corpus(cfg: Config) -> CorpusData:
    """Training and validation data of the configured dataset; validation is never trained on."""
    return DATA_SOURCES[cfg.dataset](cfg)
