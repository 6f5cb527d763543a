"""Device probe: does a torch function mode inherited through fork break a child's CUDA, with and without
Lightning's ddp_notebook?"""
import os, sys, torch, faulthandler
faulthandler.enable()
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode

class M(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

def child(pop):
    if pop:
        while _get_current_function_mode_stack():
            _pop_mode()
    torch.cuda.set_device(1)
    x = torch.ones(3, device="cuda")
    print("child ok pop=%s" % pop, x.sum().item(), flush=True)

for pop in (True, False):
    with M():
        pid = os.fork()
        if pid == 0:
            try:
                child(pop)
            except BaseException as e:
                print("child raised", pop, type(e).__name__, e, flush=True)
            os._exit(0)
        print("waitpid", pop, os.waitpid(pid, 0), flush=True)

import pytorch_lightning as pl
class Net(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.body = torch.nn.Linear(64, 64)
    def training_step(self, batch, i):
        return self.body(batch).square().mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
mode = sys.argv[1] if len(sys.argv) > 1 else "mode"
loader = torch.utils.data.DataLoader(torch.randn(64, 64), batch_size=8)
tr = pl.Trainer(accelerator="gpu", devices=2, strategy="ddp_notebook", max_steps=3, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
if mode == "mode":
    with M():
        tr.fit(Net(), loader)
else:
    tr.fit(Net(), loader)
print("lightning fit done", mode, tr.global_step, flush=True)
