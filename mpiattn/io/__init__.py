"""HDF5 input and output (the only layer below the CLI that touches files).

``paths``
    what is wrong with a path (missing, a dangling link, a link loop);
``naming``
    giving finished files their names: no-clobber, replace, replace the file read;
``temporaries``
    locked temporary directories; removing those of dead writers;
``publishing``
    the outputs a program is making, and the veto of a signal handler;
``atomic``
    outputs that appear complete under their name or not at all;
``opening``
    opening a file to read, and checking that it stays the file opened;
``schema``
    what an input file holds (datasets, shapes, dtypes, attributes), checked;
``reading``
    each rank reads only its rows of an attention problem;
``writing``
    each rank writes its rows (parallel HDF5 when available, else in turn);
``checkpoint``
    replicated parameters (layer weights);
``datagen``
    synthetic inputs, identical for a seed whatever the rank count;
``segments``
    MPI's shared-memory segment files, unnamed once mapped (a killed job leaves none).
"""

from __future__ import annotations

from .atomic import Target, check_output, check_space, check_targets, publish, write_atomically
from .checkpoint import load_params, save_params
from .opening import file_info, read_attributes
from .reading import Inputs, NonFiniteError, read_input
from .schema import SEQ_AXIS_FROM_END, read_meta
from .publishing import Outputs, Stopped
from .temporaries import Stale, remove_stale
from .naming import NEW, REPLACE, ChangedError, Rule
from .writing import CHUNK_BYTES, Rows, parallel_hdf5, rows_target, write_rows

__all__ = ["NonFiniteError", "Rows", "Inputs", "parallel_hdf5", "file_info", "read_attributes",
           "read_meta", "read_input", "check_output", "write_rows", "write_atomically", "save_params",
           "load_params", "CHUNK_BYTES", "SEQ_AXIS_FROM_END", "check_space", "remove_stale",
           "Stale", "Outputs", "Stopped", "Target", "check_targets", "publish", "rows_target", "Rule",
           "NEW", "REPLACE", "ChangedError"]
