// Unit tests of the pure parts (protocol, formatting, sparkline, saved runs, settings, the device
// feed, rendering of components) in Node; the parts that need a running JupyterLab are covered by
// ui-tests/ in Chromium. The JupyterLab packages that ship only ES modules are compiled too.
const esm = ['@jupyterlab/settingregistry', '@jupyterlab/statedb'];

/** @type {import('jest').Config} */
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/test'],
  testMatch: ['**/*.spec.ts', '**/*.spec.tsx'],
  transform: {
    '^.+\\.[jt]sx?$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }]
  },
  transformIgnorePatterns: [`/node_modules/(?!(${esm.join('|')})/)`]
};
