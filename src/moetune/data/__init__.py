"""Data in: sources (hub ids, local dirs, files) read through `datasets`, converted into
TRL's row conventions, checked row by row, mixed by weight with the run's seed, and
rendered through the model's chat template with the loss masks they give.

    sources.py   one source into rows          convert.py   columns, sharegpt, alpaca
    dirs.py      a directory's files, by kind  cap.py       rows measured by characters
    formats.py   TRL formats and row checks    mix.py       weights, seed, eval by hash
    template.py  chat templates and masks      load.py      the run's train / eval sets
    summary.py   what `moetune data` shows      rendering.py how rows became text (for eval)
    rungs.py     eval rung files, one check
"""

from moetune.data.errors import DataError
from moetune.data.formats import FORMATS, SFT_FORMATS, DataFormat, Loss
from moetune.data.load import TrainData, check_sources, load_train_data, read_checked

__all__ = [
    "FORMATS",
    "SFT_FORMATS",
    "DataError",
    "DataFormat",
    "Loss",
    "TrainData",
    "check_sources",
    "load_train_data",
    "read_checked",
]
