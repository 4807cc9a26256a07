// What a family file (qwen35moe.ts, gpt-oss.ts) hands the spec builder for each tensor: a class
// the options map to a type (`norm`: an F32 weight drawn around 1) and the draw's spread.

export type TensorClass = "attention" | "router" | "experts" | "sharedExpert" | "F32" | "norm";

export type FamilyAdd = (
  name: string,
  shape: number[],
  cls: TensorClass,
  std: number,
  mean?: number,
  perExpert?: boolean,
) => void;
