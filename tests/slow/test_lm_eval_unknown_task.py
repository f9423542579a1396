"""A task that is neither in the folder nor lm-eval's own: the error names the folder and its tasks. Apart from
tests/test_lm_eval.py, since the check indexes lm-eval's thousands of built-in tasks (3-6 minutes on a slow 2-core
machine): `make test-slow`."""
import shutil

import pytest

from posttrain.tools.lm_eval_adapter import EXAMPLE_TASKS, run


def test_unknown_task_names_the_folder_and_its_tasks(tmp_path):
    shutil.copy(EXAMPLE_TASKS / "posttrain_reasoning.yaml", tmp_path)
    with pytest.raises(KeyError, match=r"\['nope'\] not found .*posttrain_reasoning"):
        run(tmp_path / "unused", ["nope"], tmp_path)
