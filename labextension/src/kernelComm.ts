/**
 * The frontend end of the `oommagic` comm for one notebook's session: whichever kernel the session
 * has (after a restart, after "change kernel", after a page reload), the comm target is registered on
 * it and every message the kernel sends comes out of `received`, parsed.
 *
 * The kernel opens the comm (the magic does, on its first run). A page reloaded while the kernel keeps
 * running has no handle on that open comm: it asks the kernel for its open `oommagic` comms
 * (`comm_info_request`), adopts one by id and sends `{"type":"sync"}`, and the kernel answers with a
 * hello that carries every run so far.
 */

import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';

import {
  ActionRequest,
  COMM_TARGET,
  KernelMessage as OommagicMessage,
  parseKernelMessage,
  SYNC_REQUEST
} from './protocol';

export class KernelComm implements IDisposable {
  constructor(sessionContext: ISessionContext) {
    this._session = sessionContext;
    sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    this._attach(sessionContext.session?.kernel ?? null);
  }

  /** Every message the kernel sent on the comm, parsed (unknown ones included). */
  get received(): ISignal<this, OommagicMessage> {
    return this._received;
  }

  /** The kernel changed or restarted: the runs it sent before are no longer its history. */
  get reset(): ISignal<this, void> {
    return this._reset;
  }

  get kernel(): Kernel.IKernelConnection | null {
    return this._kernel;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Send an action to the kernel; false when no comm is open (no `%%gpumem` run in this kernel yet). */
  send(request: ActionRequest): boolean {
    const comm = this._comm;
    if (!comm || comm.isDisposed) {
      return false;
    }
    comm.send({ ...request });
    return true;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._session.kernelChanged.disconnect(this._onKernelChanged, this);
    this._attach(null);
    Signal.clearData(this);
  }

  private _onKernelChanged(
    _: ISessionContext,
    change: { newValue: Kernel.IKernelConnection | null }
  ): void {
    this._attach(change.newValue);
    this._reset.emit();
  }

  private _attach(kernel: Kernel.IKernelConnection | null): void {
    const old = this._kernel;
    if (old) {
      old.statusChanged.disconnect(this._onStatus, this);
      old.connectionStatusChanged.disconnect(this._onConnection, this);
      if (!old.isDisposed) {
        old.removeCommTarget(COMM_TARGET, this._onCommOpen);
      }
    }
    this._kernel = kernel;
    this._comm = null;
    if (!kernel) {
      return;
    }
    kernel.statusChanged.connect(this._onStatus, this);
    kernel.connectionStatusChanged.connect(this._onConnection, this);
    this._register(kernel);
  }

  private _register(kernel: Kernel.IKernelConnection): void {
    kernel.registerCommTarget(COMM_TARGET, this._onCommOpen);
    void this._adoptOpenComm(kernel);
  }

  private _onStatus(
    kernel: Kernel.IKernelConnection,
    status: Kernel.Status
  ): void {
    if (status === 'restarting' || status === 'autorestarting') {
      // The restart disposes every comm of the connection; the kernel's history is gone with it.
      this._comm = null;
      this._reset.emit();
      kernel.registerCommTarget(COMM_TARGET, this._onCommOpen);
    }
  }

  private _onConnection(
    kernel: Kernel.IKernelConnection,
    status: Kernel.ConnectionStatus
  ): void {
    if (status === 'connected' && !this._comm) {
      this._register(kernel);
    }
  }

  private _onCommOpen = (
    comm: Kernel.IComm,
    msg: KernelMessage.ICommOpenMsg
  ): void => {
    this._use(comm);
    this._emit(msg.content.data);
  };

  private async _adoptOpenComm(
    kernel: Kernel.IKernelConnection
  ): Promise<void> {
    if (!kernel.handleComms) {
      return;
    }
    try {
      const reply = await kernel.requestCommInfo({ target_name: COMM_TARGET });
      const comms = reply.content.status === 'ok' ? reply.content.comms : {};
      if (
        kernel !== this._kernel ||
        this._isDisposed ||
        (this._comm && !this._comm.isDisposed)
      ) {
        return;
      }
      const id = Object.keys(comms).find(commId => !kernel.hasComm(commId));
      if (id === undefined) {
        return;
      }
      const comm = kernel.createComm(COMM_TARGET, id);
      this._use(comm);
      comm.send({ ...SYNC_REQUEST });
    } catch (error) {
      // The kernel went away or restarted meanwhile; the next connection or status change tries
      // again, and the kernel's next run opens a comm anyway.
      console.debug('oommagic: no open comm adopted', error);
    }
  }

  private _use(comm: Kernel.IComm): void {
    this._comm = comm;
    comm.onMsg = msg => this._emit(msg.content.data);
    comm.onClose = () => {
      // Another frontend without this target closed it; the kernel opens a new one (with a hello)
      // on its next run.
      if (this._comm === comm) {
        this._comm = null;
      }
    };
  }

  private _emit(data: unknown): void {
    this._received.emit(parseKernelMessage(data));
  }

  private _session: ISessionContext;
  private _kernel: Kernel.IKernelConnection | null = null;
  private _comm: Kernel.IComm | null = null;
  private _isDisposed = false;
  private _received = new Signal<this, OommagicMessage>(this);
  private _reset = new Signal<this, void>(this);
}
