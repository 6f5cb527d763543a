// Unit tests of the pure parts (protocol, formatting, sparkline, saved runs, rendering of components)
// in Node; the parts that need a running JupyterLab are covered by ui-tests/ in Chromium.
/** @type {import('jest').Config} */
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/test'],
  testMatch: ['**/*.spec.ts', '**/*.spec.tsx'],
  transform: {
    '^.+\\.tsx?$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }]
  }
};
