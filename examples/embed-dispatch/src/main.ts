// `pnpm --filter @moeswarm/example-embed-dispatch start`, then:
//   curl -s localhost:8787/moe -d '{"hidden":[[0.1, ...16 numbers]],"logits":[[...8 numbers]]}'
import { createMoeService } from "./service.js";

const port = Number(process.env.PORT ?? 8787);
const { server } = createMoeService();
server.listen(port, () => {
  process.stdout.write(`MoE service on http://localhost:${port}/moe (POST {hidden, logits})\n`);
});
