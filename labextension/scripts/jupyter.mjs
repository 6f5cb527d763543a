// Run `jupyter …` for the package scripts (`jlpm build:labextension`): the `jupyter` on PATH, else
// the one of the project's virtualenv (../.venv), so that `../.venv/bin/jlpm build:prod` works
// without activating the environment first.
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { delimiter, join, resolve } from 'node:path';

const candidates = [
  ...(process.env.VIRTUAL_ENV ? [join(process.env.VIRTUAL_ENV, 'bin')] : []),
  ...(process.env.PATH ?? '').split(delimiter),
  resolve('..', '.venv', 'bin')
];
const bin = candidates.find(dir => dir && existsSync(join(dir, 'jupyter')));
if (!bin) {
  console.error(
    'jupyter not found on PATH nor in ../.venv/bin: install jupyterlab (pip install jupyterlab)'
  );
  process.exit(1);
}
// The builder calls jlpm/node itself; its own directory first keeps it in the same environment.
const env = { ...process.env, PATH: [bin, process.env.PATH].join(delimiter) };
const result = spawnSync(join(bin, 'jupyter'), process.argv.slice(2), {
  stdio: 'inherit',
  env
});
process.exit(result.status ?? 1);
