/** The panel's icon: a graphics card (fan, chip, bracket, connector teeth), drawn for oommagic. */

import { LabIcon } from '@jupyterlab/ui-components';

import gpuSvg from '../style/gpu.svg';

export const gpuIcon = new LabIcon({ name: 'oommagic:gpu', svgstr: gpuSvg });
