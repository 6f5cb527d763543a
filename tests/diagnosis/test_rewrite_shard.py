"""A distributed cell's model wrap rewritten, on the cell's text: FSDP2 in place of DistributedDataParallel
where the sharded model runs the cell's code as it stands (refused where it would not), and the model the
wrap takes handed through ``oommagic.checkpointed``."""

from __future__ import annotations

import ast

from oommagic.diagnosis.rewrite_shard import checkpoint_source, shard_source

RANK_FUNCTION = """\
from torch.nn.parallel import DistributedDataParallel
def work(rank, seen):
    device = torch.device("cpu")
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device),
                                    device_ids=None)
    optimizer = torch.optim.AdamW(model.parameters())
    seen[rank] = int(optimizer.state[model.module[0].weight]["step"])
    torch.save(model.module.state_dict(), "x.pt")
"""


def test_the_wrap_in_a_rank_function_becomes_fully_shard_and_module_reads_the_model():
    new = shard_source(RANK_FUNCTION)
    assert new is not None
    ast.parse(new)
    # Imported at the top of the cell: `import torch` inside `work` would unbind its earlier `torch.device`.
    assert new.startswith("import torch\nfrom torch.distributed.fsdp import fully_shard\n")
    body = new.split("def work(rank, seen):\n", 1)[1]
    assert "import" not in body
    assert "    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device)\n" in body
    assert "        fully_shard(fsdp_block)\n    model = fully_shard(model)" in body
    assert "DistributedDataParallel(" not in body and ".module[" not in body and ".module." not in body
    assert 'optimizer.state[model[0].weight]["step"]' in body and "torch.save(model.state_dict()" in body


def test_a_cell_that_imports_torch_is_not_given_it_twice():
    new = shard_source("import torch\nddp = DDP(model, device_ids=[rank])\ntrain(ddp)\n")
    assert new is not None and new.count("import torch\n") == 1
    assert "ddp = model\n" in new and new.rstrip().endswith("train(ddp)")


def test_the_sharded_model_would_not_run_the_cell_as_it_stands():
    # The optimizer built before the wrap holds the parameters FSDP2 replaces.
    assert shard_source("opt = torch.optim.SGD(model.parameters())\nddp = DDP(model)\n") is None
    assert shard_source("opt = AdamW(model.parameters())\nddp = DDP(model)\n") is None
    # DDP's own accumulation context has no FSDP2 twin of that name.
    assert shard_source("ddp = DDP(model)\nwith ddp.no_sync():\n    pass\n") is None
    # No wrap, or one the text cannot rewrite.
    assert shard_source("model = torch.nn.Linear(2, 2)\n") is None
    assert shard_source("x = 1; ddp = DDP(model)\n") is None
    assert shard_source("ddp = DDP(\n") is None


def test_the_model_a_wrap_takes_is_checkpointed_where_it_stands():
    new = checkpoint_source(RANK_FUNCTION)
    assert new is not None
    ast.parse(new)
    assert new.startswith("import oommagic\nfrom torch.nn.parallel import DistributedDataParallel\n")
    wrapped = "oommagic.checkpointed(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device))"
    assert f"    model = DistributedDataParallel({wrapped},\n" in new
    # Everything else as written: DDP's `.module` still reads the model.
    assert (
        new.split("\n", 1)[1].replace("oommagic.checkpointed(", "", 1).replace(")),", "),", 1)
        == RANK_FUNCTION
    )
    again = checkpoint_source("import oommagic\nnet = DDP(Net())\n")
    assert again == "import oommagic\nnet = DDP(oommagic.checkpointed(Net()))\n"
    assert checkpoint_source("model = Net()\nmodel(x).sum().backward()\n") is None
