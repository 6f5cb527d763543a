// Lint rules for the lab extension: typescript-eslint's recommended set, with formatting left to
// prettier.
import js from '@eslint/js';
import prettier from 'eslint-config-prettier';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  {
    ignores: ['lib/', 'node_modules/', 'coverage/', '../oommagic/labextension/']
  },
  js.configs.recommended,
  ...tseslint.configs.recommended,
  prettier,
  {
    files: ['**/*.ts', '**/*.tsx'],
    rules: {
      '@typescript-eslint/no-unused-vars': [
        'error',
        { argsIgnorePattern: '^_' }
      ],
      '@typescript-eslint/explicit-module-boundary-types': 'off',
      eqeqeq: 'error',
      curly: 'error',
      'prefer-arrow-callback': 'error'
    }
  }
);
