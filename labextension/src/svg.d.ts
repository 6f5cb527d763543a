// The lab extension builder loads .svg files as their source text.
declare module '*.svg' {
  const value: string;
  export default value;
}
