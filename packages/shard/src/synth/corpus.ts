// Plain English text the synthetic tokenizer learns its byte-pair merges from (written for this
// project). Its only job is to give the merges the statistics of ordinary prose, so that common
// words become single tokens and text prompts tokenise the way a real model's would.
export const TOKENIZER_CORPUS = `
The river starts in the hills above the town, where the snow melts in the spring and the water runs down through the rocks and the trees.
By the time it reaches the old mill it is wide and slow, and in the summer the children swim in the deep pool under the bridge.
People have lived beside the river for a long time. They built houses of stone and wood, planted gardens, and kept sheep on the higher fields.
Every morning the baker opened his shop before the sun was up, and the smell of fresh bread went down the street to the market square.
On market days the farmers came with their carts and sold apples, cheese, eggs, honey, and vegetables from their own land.
The teacher said that the best way to learn something is to explain it to someone else, because then you find out what you do not understand.
She wrote the numbers on the board, one after another, and asked the class to find the pattern that connected them.
A small machine can do a great deal of work if it is well designed, and a large one can do very little if nobody knows how to use it.
The engineers measured every part twice before they cut the metal, and they tested the engine for three days before they were satisfied.
When the weather changed, the wind came from the west and brought rain that lasted for a week, and the river rose almost to the top of its banks.
Some of the older people remembered a flood many years ago, when the water reached the doors of the houses near the church.
After that the town built a wall along the river and planted willows whose roots held the soil in place.
In the evening the family sat together at the table, talked about the day, and shared a simple meal of soup, bread, and fruit.
The grandmother told stories about her own childhood, about the long walk to school in winter and the games they played in the fields.
Good stories are like good tools: they are made for a purpose, they fit the hand, and they last for a long time if you take care of them.
The library was open every afternoon, and anyone could borrow books about history, science, music, travel, cooking, and the stars.
A young student spent many hours there reading about the planets, the moon, and the light that travels from distant stars for thousands of years.
She learned that the same laws describe the fall of an apple and the motion of the planets around the sun.
Later she studied mathematics and physics at the university in the city, and she worked on problems that nobody had solved before.
Her first experiment failed, and so did the second, but the third one worked, and she wrote a paper that other scientists read and discussed.
Science moves forward in small steps, each one checked carefully, and sometimes a single careful measurement changes what everyone believes.
The computer in the laboratory could process millions of numbers every second, but it still needed a person to ask the right question.
Programs are written by people for other people to read, and only incidentally for machines to execute.
A clear program is easier to change, easier to test, and less likely to hide mistakes that appear only when it matters most.
The network connected computers across the world, so that a message sent from one country arrived in another in less than a second.
Information flows through cables under the sea, through the air as radio waves, and through light in thin glass fibres.
Each message is divided into small packets, and each packet finds its own way to the destination, where they are put back together in order.
If a packet is lost, it is sent again, and the receiver waits until the whole message is complete before it uses the data.
The same idea works for large files: they are cut into pieces, the pieces travel independently, and a checksum proves that nothing was changed.
In the kitchen the cook prepared the vegetables first, then the sauce, and finally the meat, so that everything was ready at the same time.
She used fresh herbs from the garden, a little salt, some pepper, and olive oil, and the dish tasted better than anything in a restaurant.
Cooking is a kind of chemistry: heat changes the structure of food, and small differences in time and temperature make a large difference in taste.
The musician practised the same piece every day for a month, slowly at first and then faster, until her fingers found the notes without thinking.
Music, like language, has a grammar of its own, and a listener can feel when a phrase is complete even without knowing why.
At the concert the hall was full, the lights went down, and for an hour nobody moved while the orchestra played.
Travel teaches patience. Trains are late, roads are closed, and plans change, but the people you meet along the way are often the best part of the journey.
The map showed mountains in the north, forests in the east, and a long coast in the south with small harbours and fishing villages.
Fishermen went out before dawn and came back in the afternoon with boxes of fish that they sold directly on the quay.
The sea can be calm and blue in the morning and dark and dangerous by the evening, and sailors learn to watch the sky and the water.
Good decisions usually come from good information, and good information comes from asking questions and listening to the answers.
A company that listens to its customers learns what they need, and a company that only talks to them learns very little.
The new bridge took two years to build. Workers poured concrete, raised steel beams, and painted everything against the salt air.
When it opened, the whole town walked across it, and the mayor gave a short speech that nobody remembered but everybody enjoyed.
History is not only about kings and wars; it is also about ordinary people, what they ate, how they worked, and what they hoped for their children.
The museum kept tools, clothes, letters, and photographs, and each object told a small part of a larger story.
Years later the student returned to the town as a professor. The mill was a museum now, the bridge was new, but the river was the same.
She walked along the water in the evening, thought about the questions she still wanted to answer, and decided that there was time enough for all of them.
Numbers like 1, 2, 3, 10, 42, 100, and 2024 appear in text as well, and so do words such as model, expert, layer, token, and weight.
A model with many experts sends each token to only a few of them, so most of the weights rest while a small part of the network does the work.
The router chooses the experts for each token, the experts compute their outputs, and the results are added together with the router's weights.
If the experts live on different machines, the activations travel over the network, and the answers come back before the next layer begins.
`;
